"""Plan + captured graph → one module per stage."""
