"""spawn from a script without a ``__main__`` guard: the children must not re-run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = '''
import json, operator
from orgel.launch.spawn import spawn
print("script ran", flush=True)  # once: the children never import this file
print(json.dumps(spawn(operator.add, 2, timeout=30.0)))  # rank + world on each rank
'''


@pytest.mark.slow
def test_spawn_from_an_unguarded_script(tmp_path: Path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines.count("script ran") == 1
    assert lines[-1] == "[2, 3]"
