"""tests/warm.py, which the other tests run the scripts through: a run forked from its server exits, prints and fails
as the same script does in a fresh interpreter."""

import os
import subprocess
import sys

import pytest
from conftest import REPO
from warm import Server

SCRIPTS = {
    "ok": "import os, sys, torch\nprint(sys.argv[1:], __name__, os.getcwd(), os.environ.get('WARM_TEST'))\n",
    "error": "print('before')\nraise SystemExit('error: a bad flag')\n",
    "status": "import sys\nsys.exit(3)\n",
    "crash": "def f():\n    raise ValueError('boom')\n\n\nf()\n",
}


def test_a_run_from_the_server_behaves_as_in_a_fresh_interpreter(tmp_path):
    server = Server(REPO)
    env = {**os.environ, "WARM_TEST": "1"}
    try:
        for name, code in SCRIPTS.items():
            (tmp_path / f"{name}.py").write_text(code + "print('parent', os.getppid())\n" * (name == "ok"))
            argv = [sys.executable, str(tmp_path / f"{name}.py"), "--flag", "x y"]
            fresh = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
            warm = server.run(argv, cwd=tmp_path, env=env, timeout=120)
            assert warm.returncode == fresh.returncode, (name, warm, fresh)
            if name == "ok":  # the same output, but from a child of the server, not a fresh interpreter
                assert warm.stdout.split("parent")[0] == fresh.stdout.split("parent")[0]
                assert f"parent {server.proc.pid}" in warm.stdout and f"parent {os.getpid()}" in fresh.stdout
            else:
                assert warm.stdout == fresh.stdout
            assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], (warm.stderr, fresh.stderr)
            assert warm.stderr.startswith("Traceback") == fresh.stderr.startswith("Traceback")

        # a run that outlives its timeout is killed, as subprocess.run's would be
        (tmp_path / "slow.py").write_text("import time\ntime.sleep(600)\n")
        with pytest.raises(subprocess.TimeoutExpired):
            server.run([sys.executable, str(tmp_path / "slow.py")], cwd=tmp_path, env=env, timeout=1)

        # another environment (here one variable; PYTHONPATH would be read only as an interpreter starts) runs fresh
        other = server.run([sys.executable, str(tmp_path / "ok.py")], cwd=tmp_path, env={**env, "WARM_TEST": "2"}, timeout=120)
        assert other.returncode == 0 and " 2\n" in other.stdout and f"parent {os.getpid()}" in other.stdout
    finally:
        server.close()
