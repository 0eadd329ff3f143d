"""Run a repository script as `python rloo.py ...` would, in a process of its own, without importing torch,
transformers and the rest again for every run: a server process imports them once, then forks a child per run. The
child takes the run's working directory, environment, arguments and output files, executes the script as __main__
and exits as the interpreter would (an uncaught exception: its traceback and status 1; SystemExit("error: ...") that
line and status 1; utils.die's line, printed as it stops, and its status, 2 or 1). The script's own state starts
fresh in each child: the server never runs it.

A run whose environment differs from the server's (PYTHONPATH, PATH, WANDB_MODE, ...: what an interpreter or a module
may read as it starts or is imported) gets a fresh interpreter instead, and so does every run when
TESTS_FRESH_INTERPRETER=1 is set. Runs of several processes (accelerate launch) always start fresh interpreters."""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile

SERVER = r"""
import json, os, runpy, sys, traceback
requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the imports print (DeepSpeed does) stays off the replies
sys.path.insert(0, {repo!r})
import datasets, deepspeed, infra, utils  # what every script imports (torch, transformers, accelerate, tyro with them)
import transformers.models.gpt_neox.modeling_gpt_neox, transformers.models.llama.modeling_llama  # the tests' models
del sys.path[0]
del infra, utils  # (the names only: sys.modules keeps the modules, which a script's own imports then find)
base_path = list(sys.path[1:])
sys.stdout.flush()
sys.stderr.flush()
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the run: its folder, environment, files and arguments, then the script as __main__
        requests.close()
        replies.close()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in [(0, os.devnull), (1, request["stdout"]), (2, request["stderr"])]:
            opened = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = request["argv"]
        sys.path[:] = [os.path.dirname(os.path.abspath(sys.argv[0])), *base_path]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit:
            raise  # the interpreter's own handling: its code, or its message on stderr and status 1
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    replies.write(json.dumps({{"pid": pid}}) + "\n")
    replies.flush()
    replies.write(json.dumps({{"rc": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}}) + "\n")
    replies.flush()
"""


class Server:
    def __init__(self, repo):
        self.repo, self.proc, self.env, self.last = repo, None, None, None

    def usable(self, env):
        """whether the server can run with env: started at the first run, with that run's environment; started again
        with another once two runs in a row have it (a variable that a library sets in the middle of the session)"""
        env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # (pytest's own, set for each test)
        if os.environ.get("TESTS_FRESH_INTERPRETER") == "1" or (self.proc is not None and self.proc.poll() is not None):
            return False  # (a server that died: fresh interpreters from then on)
        if env != self.env and env == self.last:
            self.close()
        self.last = env
        if self.proc is None:
            self.env = env
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER.format(repo=self.repo)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # (its imports' warnings; each run has files of its own)
                text=True,
                env=env,
                cwd=self.repo,
            )
        return env == self.env and self.proc.poll() is None

    def run(self, argv, cwd, env, timeout):
        """subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout), argv[0] the
        interpreter, argv[1] the script"""
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            open(out, "w").close(), open(err, "w").close()
            request = {"argv": argv[1:], "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            pid = None
            if self.usable(env):
                try:
                    self.proc.stdin.write(json.dumps(request) + "\n")
                    self.proc.stdin.flush()
                    pid = json.loads(self.proc.stdout.readline())["pid"]
                except (BrokenPipeError, json.JSONDecodeError):  # the server could not start, or died
                    pass
            if pid is None:
                return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                os.kill(pid, signal.SIGKILL)
            rc = json.loads(self.proc.stdout.readline())["rc"]
            stdout, stderr = open(out).read(), open(err).read()
        if not ready:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc = self.env = None
