"""Options live in one typed place; what a front end cannot take is refused from one table."""

from __future__ import annotations

import inspect

import pytest
import torch

import orgel
from orgel.flow.options import REFUSED, Options, names, options, refuse


def test_options_are_grouped_as_a_user_thinks_of_them() -> None:
    opts = options(ranks=4, dp=2, accumulate=2, precision="bf16-mixed", timeout_s=60.0)
    assert isinstance(opts, Options)
    assert (opts.parallel.ranks, opts.parallel.dp) == (4, 2)
    assert opts.loop.accumulate == 2 and opts.precision.precision == "bf16-mixed"
    assert opts.launch.timeout_s == 60.0
    assert opts.given() == {"ranks": 4, "dp": 2, "accumulate": 2, "precision": "bf16-mixed",
                            "timeout_s": 60.0}
    with pytest.raises(TypeError, match="did you mean 'accumulate'"):
        options(acumulate=2)


def test_every_option_of_orgel_pipeline_has_a_group() -> None:
    # the typed options and orgel.pipeline's keywords are the same set, so that every front
    # end takes each option or refuses it from the table
    keywords = {name for name, p in inspect.signature(orgel.pipeline).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == set(names())


@pytest.mark.parametrize("key", sorted(k for k in REFUSED if k[0] == "backend"))
def test_orgel_backend_refuses_from_the_table_before_anything_starts(
        key: tuple[str, str]) -> None:
    name, _, value = key[1].partition("=")
    given = {name: value or {"tp": 2, "dp": 2, "shard": "fsdp", "compile": True,
                             "check_finite": True, "loss_rule": "rows",
                             "loss_scale": {"init": 2.0}, "init": print,
                             "weights": {}}.get(name, True)}
    if name == "shard":
        given["dp"] = 1
    with pytest.raises(ValueError) as info:
        orgel.backend(ranks=4, **given)
    assert str(info.value) in REFUSED.values()


def test_refuse_ignores_options_left_off() -> None:
    refuse("backend", {"tp": 1, "dp": 1, "shard": "none", "check_finite": False,
                       "device": None})
    with pytest.raises(ValueError, match="in orgel.backend the loss is the closure's"):
        refuse("backend", options(check_finite=True))


def test_a_forward_with_graph_breaks_is_refused_from_the_table() -> None:
    # on CUDA ranks (which this machine lacks: orgel.pipeline's check_graph calls this with
    # the device it resolved); compile=True is no longer refused (tests/test_compiled.py)
    with pytest.raises(ValueError) as info:
        refuse("graph breaks", {"compile": True, "device": "cuda"})
    assert str(info.value) == REFUSED[("graph breaks", "device=cuda")]
    refuse("graph breaks", {"compile": True, "device": "cpu"})


def test_orgel_backend_shares_the_closures_among_dp_replicas_evenly() -> None:
    with pytest.raises(ValueError, match="give microbatches a multiple of dp"):
        orgel.backend(ranks=4, dp=2, microbatches=3)


def test_a_schedule_instead_of_a_plan_is_checked_before_anything_starts() -> None:
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    loss = torch.nn.functional.mse_loss
    with pytest.raises(ValueError, match="schedule must be a schedule family, one of 1f1b"):
        orgel.pipeline(model, (x,), y, loss, schedule="1F1B")
    with pytest.raises(ValueError, match="give plan= or schedule=, not both"):
        orgel.pipeline(model, (x,), y, loss, schedule="1f1b", plan="plan.json")
    with pytest.raises(ValueError, match="memory= is a limit for the planner"):
        orgel.pipeline(model, (x,), y, loss, schedule="1f1b", memory=2**30)
    with pytest.raises(ValueError, match="give microbatches as an int"):
        orgel.pipeline(model, (x,), y, loss, schedule="1f1b", microbatches="auto")
    with pytest.raises(ValueError, match="schedule must be a schedule family"):
        orgel.backend(schedule="zbv")
