"""`snapshot-kernel fleet`: N servers on one bucket and HAProxy in front, on one machine.

For trying a fleet and for testing one: the same HAProxy configuration as a
deployment on several machines (deploy/haproxy.cfg, shipped in the package),
its server lines filled in for the servers started here. Everything runs in
the foreground; SIGTERM or Ctrl-C stops HAProxy, then every server. A server
that exits is started again on its own cache after RESTART_S (as systemd's
Restart= would), so SIGTERM to one server restarts it drained: a rolling
restart is that, one server after the other.
"""

import importlib.resources
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

# Loopback requests go straight, whatever http_proxy says.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

from snapkernel.kernel import launch

# Seconds between looks at the children.
_POLL_S = 0.2
# Seconds a server that exited stays down before it is started again (systemd's RestartSec).
RESTART_S = 1.0
# How long the fleet waits for a stopping child before it kills it.
_STOP_S = 30
# How long a server may take to answer /health after its start.
_START_S = 120


class FleetError(Exception):
    """The fleet cannot start; the message says why in one line."""


def haproxy_config(servers):
    """deploy/haproxy.cfg with a `server` line for each (name, port) of `servers`."""
    text = importlib.resources.files("snapkernel").joinpath(
        "deploy/haproxy.cfg").read_text("utf-8")
    lines = [f"    server {name} 127.0.0.1:{port}" for name, port in servers]
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


def free_port():
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Member:
    """One server of the fleet: its name, port, cache folder and current process."""

    def __init__(self, name, port, data_dir, argv, env, log_path):
        """Describe it; start() starts it."""
        self.name, self.port, self.data_dir = name, port, data_dir
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc = None
        self.down_since = None  # when it was seen exited

    def start(self):
        """Start the server process (its output appended to its log)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        self.down_since = None

    def wait_up(self):
        """Wait until it answers /health; FleetError if it exits or never does."""
        _wait_health(self.proc, f"http://127.0.0.1:{self.port}/health", self.name,
                     f": see {self.log_path}")

    def say(self, what="up"):
        """The line that tells where it is."""
        print(f"{self.name}: http://127.0.0.1:{self.port} pid {self.proc.pid} ({what}; "
              f"cache {self.data_dir}, log {self.log_path})", flush=True)


def run(args):
    """Run the fleet the command line asks for until SIGTERM or Ctrl-C; the exit status."""
    haproxy = shutil.which("haproxy")
    if not haproxy:
        raise FleetError("HAProxy is not installed (Debian, Ubuntu: apt-get install haproxy)")
    host, _, port = args.bind.rpartition(":")
    root = os.path.abspath(args.data_root)
    os.makedirs(root, exist_ok=True)
    env = launch.env(dict(os.environ))
    env["SNAPSHOT_KERNEL_TOKEN"] = args.token
    members = []
    for k in range(1, args.servers + 1):
        name, member_port = f"server-{k}", free_port()
        data_dir = os.path.join(root, name)
        argv = launch.command("from snapkernel.main import main; main()",
                              "--bind", f"127.0.0.1:{member_port}", "--data-dir", data_dir,
                              "--server-id", name, "--drain-s", str(args.drain_s))
        if args.config:
            argv += ["--config", os.path.abspath(args.config)]
        members.append(Member(name, member_port, data_dir, argv, env,
                              os.path.join(root, f"{name}.log")))
    config_path = os.path.join(root, "haproxy.cfg")
    with open(config_path, "w") as f:
        f.write(haproxy_config([(m.name, m.port) for m in members]))
    proxy_env = dict(os.environ, SNAPSHOT_FLEET_BIND=f"{host}:{port}",
                     SNAPSHOT_FLEET_STATS=f"127.0.0.1:{args.stats_port or free_port()}")
    check = subprocess.run([haproxy, "-c", "-q", "-f", config_path], env=proxy_env,
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise FleetError(f"HAProxy refuses {config_path}: "
                         f"{(check.stderr or check.stdout).strip().splitlines()[-1:]}")

    stopping = []

    def stop(*_):
        """SIGTERM or Ctrl-C: stop everything (once)."""
        stopping.append(True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    proxy = None
    try:
        for member in members:
            member.start()
        for member in members:
            member.wait_up()
            member.say()
        with open(os.path.join(root, "haproxy.log"), "ab") as log:
            proxy = subprocess.Popen([haproxy, "-db", "-f", config_path], env=proxy_env,
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        _wait_proxy(proxy, host, port)
        print(f"haproxy: http://{host}:{port} pid {proxy.pid} (stats "
              f"http://{proxy_env['SNAPSHOT_FLEET_STATS']}/)", flush=True)
        while not stopping:
            time.sleep(_POLL_S)
            if proxy.poll() is not None:
                print(f"haproxy exited with status {proxy.returncode}: see "
                      f"{os.path.join(root, 'haproxy.log')}; stopping", file=sys.stderr,
                      flush=True)
                return 1
            for member in members:
                _look_after(member, stopping)
        return 0
    finally:
        _stop_all([proxy] + [m.proc for m in members])


def _wait_proxy(proxy, host, port):
    """Wait until HAProxy answers /health through to a server; FleetError if it exits."""
    address = "127.0.0.1" if host in ("0.0.0.0", "") else host.strip("[]")
    _wait_health(proxy, f"http://{address}:{port}/health", "HAProxy")


def _wait_health(proc, url, name, see=""):
    """Wait until `url` answers; FleetError naming `name` if `proc` exits first or
    _START_S passes (`see`: where to read why)."""
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FleetError(f"{name} exited with status {proc.returncode} on starting{see}")
        try:
            with _OPENER.open(url, timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise FleetError(f"{name} did not answer in {_START_S} s{see}")


def _look_after(member, stopping):
    """Start `member` again RESTART_S after it exited (unless the fleet is stopping)."""
    if member.proc.poll() is None or stopping:
        return
    if member.down_since is None:
        member.down_since = time.monotonic()
        print(f"{member.name}: pid {member.proc.pid} exited ({_how(member.proc.returncode)});"
              f" starting it again", flush=True)
    elif time.monotonic() - member.down_since >= RESTART_S:
        member.start()
        member.say("started again")


def _how(code):
    """A process's end, in words."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"


def _stop_all(procs):
    """SIGTERM twice (a draining server then stops at once), then SIGKILL past _STOP_S."""
    procs = [p for p in procs if p is not None and p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        time.sleep(0.2)
    deadline = time.monotonic() + _STOP_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
