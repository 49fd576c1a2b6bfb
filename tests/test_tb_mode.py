"""TensorBoard event files are created with the run dir's file mode (0600), not chmodded after creation.

The check runs in a fresh interpreter with an audit hook (``sys.addaudithook`` cannot be removed): at
the ``open`` that creates the event file, the hook reads the process umask, so the test sees the mode
the file is born with, not only the mode it ends with. Real TensorBoard writer, real files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch.utils.tensorboard", reason="tensorboard is an optional extra")

CHILD = textwrap.dedent("""
    import io, json, os, sys
    opened = []

    def hook(event, args):
        if event == "open" and "tfevents" in os.fsdecode(args[0]):
            umask = os.umask(0o777)  # read it: set, then put back at once
            os.umask(umask)
            opened.append([os.fsdecode(args[0]), str(args[1]), umask])

    sys.addaudithook(hook)
    os.umask(0o022)  # the usual umask: a file created under it is 0644
    from hpcrl.run.metrics import RunLogger

    log = RunLogger(sys.argv[1], True, 10, tensorboard=True, stream=io.StringIO())
    log.log({"env_steps": 10, "updates": 1, "loss": 1.0})
    log.close()
    print(json.dumps({"opened": opened, "umask_after": os.umask(0o022)}))
""")


def test_event_files_are_created_0600_not_chmodded_after(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    creating = [o for o in got["opened"] if "w" in o[1]]
    if not got["opened"]:
        pytest.skip("the TensorBoard writer does not open its file through Python here (TensorFlow's gfile)")
    assert creating, got["opened"]
    for path, mode, umask in creating:
        assert 0o666 & ~umask == 0o600, (path, mode, oct(umask))  # born 0600: nothing to chmod
    assert got["umask_after"] == 0o022  # the process's umask is back as it was
    files = list((run / "tb").iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files), [oct(f.stat().st_mode) for f in files]
