"""What the scripts that drive a real `hearth serve` share (openai_sdk_check.py,
dashboard_check.py): the server on a free port with a fresh data directory, the CLI against
that directory, and the count of checks passed and failed."""
import os
import subprocess
import sys
import tempfile
import time


class Serve:
    """`hearth serve` on 127.0.0.1:0 with a fresh data directory (`extra_env` added)."""

    def __init__(self, hearth, tag, extra_env=None):
        self.hearth = hearth
        self.data = tempfile.mkdtemp(prefix=f"hearth-{tag}-")
        self.env = dict(os.environ, HEARTH_LOG="warn", **(extra_env or {}))
        self.proc = subprocess.Popen([hearth, "serve", "--listen", "127.0.0.1:0", "--data-dir", self.data],
                                     stdout=subprocess.PIPE, text=True, env=self.env)

    def wait_url(self, timeout=180):
        """The base URL it printed once listening (exits the script if it died first)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                sys.exit("hearth serve exited before listening")
            if "listening on " in line:
                return line.split("listening on ")[1].split()[0]
        sys.exit("hearth serve did not start listening")

    def admin(self, *args):
        """`hearth admin --json ARGS` on this server's data directory; its stdout."""
        return subprocess.run([self.hearth, "admin", "--data-dir", self.data, "--json", *args],
                              check=True, capture_output=True, text=True, env=self.env).stdout

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Checks:
    """Prints each check as ok/FAIL and counts them."""

    def __init__(self):
        self.passed = self.failed = 0

    def __call__(self, name, cond, detail=""):
        if cond:
            self.passed += 1
            print(f"ok   {name}")
        else:
            self.failed += 1
            print(f"FAIL {name} {detail}")

    def exit(self, label):
        print(f"{label}: {self.passed} passed, {self.failed} failed")
        sys.exit(1 if self.failed else 0)
