"""The command line of the snapshot kernel: it parses, then hands over.

    main.py [serve] --bind HOST:PORT --token TOKEN ...   the server (api/server.py)
    main.py run NB.ipynb ...                            run a notebook (frontends/run.py)
    main.py install-kernelspec ...                      the Jupyter kernel (frontends/jupyter/kernelspec.py)
    main.py fleet --servers N ...                       servers and HAProxy on one machine (kernel/fleet.py)

Serving is the default: the reference's command line (options only) starts
the server. Installed, this is the console command `snapshot-kernel`.
bottle's own command line serves the same app (`python -m bottle --server
cheroot --bind HOST:PORT --param token=TOKEN main:app`: bottle has no
--token flag; --param puts the token into the app's config, where it is
read from).
"""

import argparse
import ipaddress
import logging
import os
import sys

from snapkernel.kernel import config as config_mod
from snapkernel.kernel.notebook.model import ORDERS, FreshOptions

COMMANDS = ("serve", "run", "install-kernelspec", "fleet")


def __getattr__(name):
    """`app`, the bottle app that bottle's command line serves (main:app): imported when
    asked for, so that `serve` starts the workers' zygote before these imports."""
    if name == "app":
        from snapkernel.api.routes import app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parser():
    """The command line: a sub-command and its options."""
    # argparse names the program as invoked: `snapshot-kernel` (the console command) or
    # `main.py` (python main.py, python -m snapkernel.main).
    p = argparse.ArgumentParser(
        description="Snapshot kernel: a server that runs notebook cells against named, "
                    "immutable, persistent states")
    commands = p.add_subparsers(dest="command", metavar="{serve,run,install-kernelspec,fleet}")
    _serve_options(commands.add_parser(
        "serve", help=f"serve the HTTP API (the default: `{p.prog} --bind ...` serves)",
        description="Serve the HTTP API until SIGTERM or Ctrl-C"))
    p.run_parser = commands.add_parser(
        "run", help="run a notebook (.ipynb) and write it back executed",
        description="Run a notebook (.ipynb) on the state store without a server: only the "
                    "cells whose result could have changed run, the others are reused from "
                    "the store. Writes the executed notebook. Exit status 0 when every cell "
                    "ran or was reused, 1 when a cell failed or could not run, 2 on bad "
                    "input. Parameters (-p, -r, -f, -y) are papermill's: they go into a cell "
                    "tagged injected-parameters after the cell tagged parameters.")
    _run_options(p.run_parser)
    _kernelspec_options(commands.add_parser(
        "install-kernelspec", help="make the Jupyter kernel known to Jupyter",
        description="Install the Jupyter kernelspec of the snapshot kernel (display name "
                    "\"Python (snapshot)\")"))
    _fleet_options(commands.add_parser(
        "fleet", help="N servers on one bucket and HAProxy in front, on this machine",
        description="Start N servers (each with its cache DATA_ROOT/server-K) and HAProxy "
                    "in front of them (deploy/haproxy.cfg), in the foreground; a server "
                    "that exits is started again; SIGTERM or Ctrl-C stops them all. The "
                    "servers share the bucket of --config's [store] remote"))
    return p


def _fleet_options(p):
    """The options of `fleet`."""
    p.add_argument("--servers", type=int, default=2, help="how many (default %(default)s)")
    p.add_argument("--bind", default="127.0.0.1:8080",
                   help="HOST:PORT of HAProxy, where clients connect (default %(default)s)")
    p.add_argument("--token", default=os.environ.get("SNAPSHOT_KERNEL_TOKEN"),
                   help="the servers' token (default: $SNAPSHOT_KERNEL_TOKEN)")
    p.add_argument("--config", help="the servers' TOML file (shared.toml: [store] remote ...)")
    p.add_argument("--data-root", required=True,
                   help="folder of the servers' caches and logs, and HAProxy's configuration")
    p.add_argument("--drain-s", type=float, default=3.0,
                   help="each server's server.drain_s (default %(default)s)")
    p.add_argument("--stats-port", type=int, help="port of HAProxy's status page on "
                                                   "127.0.0.1 (default: a free one)")


def _serve_options(p):
    """The options of `serve`."""
    p.add_argument("--bind", default="127.0.0.1:8080", help="HOST:PORT (default %(default)s)")
    p.add_argument("--token", default=os.environ.get("SNAPSHOT_KERNEL_TOKEN"),
                   help="secret token every request must carry (or SNAPSHOT_KERNEL_TOKEN)")
    p.add_argument("--no-auth", action="store_true",
                   help="serve without a token (loopback binds only)")
    _data_dir_option(p)
    p.add_argument("--config", help="a TOML file overriding config.toml")
    p.add_argument("--server-id", help="this server's name in a fleet (server.id; default "
                                       "HOSTNAME:PORT)")
    p.add_argument("--drain-s", type=float, help="seconds a SIGTERM drains before the stop "
                                                 "(server.drain_s)")
    p.add_argument("--display-max-rows", type=int, help="pandas display.max_rows")
    p.add_argument("--display-max-columns", type=int, help="pandas display.max_columns")
    p.add_argument("--display-max-colwidth", type=int, help="pandas display.max_colwidth")
    p.add_argument("--verbose", action="store_true", help="log to stderr")


def _data_dir_option(p):
    """--data-dir, its help naming the folder the store is in by default."""
    p.add_argument("--data-dir", help=f"folder of the state store "
                                      f"({config_mod.data_dir_help()})")


def _run_options(p):
    """The options of `run`."""
    p.add_argument("notebook", help="the .ipynb file to run")
    p.add_argument("-o", "--output", help="where to write the executed notebook (default: "
                                          "the notebook file itself; with --fresh, none: "
                                          "a fresh run never writes over its source)")
    given = p.add_argument_group(
        "parameters", "as papermill's: later ones win, files first, then -y, -p and -r")
    given.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                       metavar=("NAME", "VALUE"),
                       help="a parameter; VALUE read as papermill reads it (True, False, "
                            "None, an int, a float, else a string)")
    given.add_argument("-r", "--parameter-raw", nargs=2, action="append", default=[],
                       metavar=("NAME", "VALUE"), help="a parameter whose VALUE is a string")
    given.add_argument("-f", "--parameters-file", action="append", default=[],
                       metavar="FILE", help="a YAML (or JSON) file of parameters")
    given.add_argument("-y", "--parameters-yaml", action="append", default=[],
                       metavar="YAML", help="parameters as a YAML text")
    p.add_argument("--order", choices=ORDERS, default="notebook",
                   help="notebook: top to bottom, as Jupyter; dataflow: each cell after the "
                        "cells defining what it reads (default %(default)s)")
    p.add_argument("--rerun", nargs="+", action="extend", default=[], metavar="ID",
                   help="run these cells (by cell id) and everything downstream of them, "
                        "even if nothing changed")
    _data_dir_option(p)
    p.add_argument("--config", help="a TOML file overriding config.toml")
    p.add_argument("--server", metavar="URL",
                   help="run through the server at URL instead (for a store a server holds)")
    p.add_argument("--token", default=os.environ.get("SNAPSHOT_KERNEL_TOKEN"),
                   help="with --server: its token (or SNAPSHOT_KERNEL_TOKEN)")
    p.add_argument("--cwd", help="working directory of the cells (default: the notebook's "
                                 "folder)")
    p.add_argument("--allow-errors", action="store_true",
                   help="go on past a failing cell (the cells after it see what it did "
                        "before it raised), as nbclient's --allow-errors; cells tagged "
                        "raises-exception may always fail")
    p.add_argument("--verbose", action="store_true", help="log the kernel to stderr")
    fresh = p.add_argument_group(
        "fresh runs", "--fresh: every cell from scratch in a new interpreter, within limits, "
                      "without the store; the executed notebook is written only if every cell "
                      "passed, and a receipt says what ran where")
    fresh.add_argument("--fresh", action="store_true", help="run fresh")
    fresh.add_argument("--receipt", help="where to write the run's receipt (JSON)")
    p.add_argument("--timeout", type=float,
                   help="whole-run deadline in seconds (default: none; with --fresh, "
                        "fresh.timeout_s)")
    p.add_argument("--cell-timeout", type=float,
                   help="longest run of one cell in seconds, 0: none (default: "
                        "limits.cell_timeout_s; with --fresh, fresh.cell_timeout_s); a cell "
                        "past it is interrupted and fails with Timeout")
    fresh.add_argument("--env", action="extend", nargs="+", default=[], metavar="NAME",
                       help="pass this variable from the environment (must be set)")
    fresh.add_argument("--lock", help="a lock file whose hash and path the receipt records")
    fresh.add_argument("--expected-environment", metavar="SHA256",
                       help="refuse to run unless the kernel's environment has this hash")
    fresh.add_argument("--overwrite", action="store_true", help="replace an existing output")
    fresh.add_argument("--keep-states", metavar="DIR",
                       help="keep the run's states in this new store folder")


# The options of `run` that a fresh run does not take (it uses no store).
_STORE_ONLY = ("rerun", "data_dir", "server", "allow_errors")


def _kernelspec_options(p):
    """The options of `install-kernelspec`."""
    from snapkernel.frontends.jupyter.kernelspec import DEFAULT_NAME
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true",
                       help="install for this user rather than system-wide")
    p.add_argument("--name", default=DEFAULT_NAME,
                   help="kernelspec name; each name has its own store (default %(default)s)")
    where.add_argument("--prefix",
                       help="install under this prefix (e.g. a virtualenv's sys.prefix)")
    p.add_argument("--config", help="a TOML file overriding config.toml for this kernelspec's "
                                    "kernel and server")


def parse(argv):
    """The parsed command line; argparse exits with status 2 on bad arguments."""
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]  # the reference's command line: options only
    p = parser()
    args = p.parse_args(argv)
    args.prog = p.prog
    if args.command == "run":
        _check_run(p.run_parser, args)
    return args


def _check_run(p, args):
    """Refuse options of the other kind of run; gather a fresh run's options in
    `args.fresh` (a FreshOptions, or None for an incremental run) and the parameters in
    `args.parameters`."""
    from snapkernel.kernel.notebook import parameters
    try:
        args.parameters = parameters.from_command_line(
            args.parameters_file, args.parameters_yaml, args.parameter, args.parameter_raw)
    except parameters.ParameterError as exc:
        p.error(str(exc))
    fresh_only = [n for n in FreshOptions.names(shared=False) if n != "env"]
    given = [n for n in (_STORE_ONLY if args.fresh else fresh_only + ["env"])
             if getattr(args, n) not in (None, [], False)]
    if args.fresh and args.order != "notebook":
        given.append("order")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        p.error(f"{flags}: only with --fresh" if not args.fresh
                else f"{flags}: not with --fresh (a fresh run uses no store)")
    args.fresh = FreshOptions(**{n: getattr(args, n) for n in FreshOptions.names()}) \
        if args.fresh else None


def settings_of(args, overrides=()):
    """The configuration the command line asks for: config.toml, --config, then the
    flags; exits with status 2 and the problem otherwise."""
    overrides = dict(overrides)
    if getattr(args, "data_dir", None):
        overrides["server.data_dir"] = os.path.abspath(args.data_dir)
    try:
        return config_mod.load(args.config, overrides)
    except config_mod.ConfigError as exc:
        refuse(args, str(exc))


def refuse(args, message):
    """Say what is wrong with the command line and exit with status 2."""
    print(f"{args.prog} {args.command}: error: {message}", file=sys.stderr)
    sys.exit(2)


def setup_logging(log_file, verbose):
    """Logs go to the log file, or to stderr with --verbose; otherwise nowhere (a
    client that pipes our stderr and never reads it must not block us)."""
    handlers = []
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    if not handlers:
        handlers.append(logging.NullHandler())
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(levelname)s %(message)s")


def _fleet(args):
    """Run `fleet`; its exit status (2 and the problem when it cannot start)."""
    from snapkernel.kernel import fleet
    host, _, port = args.bind.rpartition(":")
    if not host or not port.isdigit():
        refuse(args, f"--bind must be HOST:PORT, not {args.bind!r}")
    if not args.token:
        refuse(args, "no token: pass --token or set SNAPSHOT_KERNEL_TOKEN")
    if args.servers < 1:
        refuse(args, f"--servers must be 1 or more, not {args.servers}")
    settings_of(args)  # the servers' configuration, refused here if it is wrong
    try:
        return fleet.run(args)
    except fleet.FleetError as exc:
        refuse(args, str(exc))


def is_loopback(host):
    """True for a loopback bind address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main(argv=None):
    """Parse the command line and run the command it names."""
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.command == "install-kernelspec":
        from snapkernel.frontends.jupyter.kernelspec import install
        sys.exit(install(args.name, args.user, args.prefix, args.config))
    if args.command == "run":
        from snapkernel.frontends.run import run
        settings = settings_of(args)
        setup_logging(settings["server.log_file"], args.verbose)
        sys.exit(run(args, settings))
    if args.command == "fleet":
        sys.exit(_fleet(args))
    # Workers inherit the environment: cells must not find the token there.
    os.environ.pop("SNAPSHOT_KERNEL_TOKEN", None)
    host, _, port = args.bind.rpartition(":")
    if not host or not port.isdigit():
        refuse(args, f"--bind must be HOST:PORT, not {args.bind!r}")
    if not args.token and not (args.no_auth and is_loopback(host)):
        refuse(args, "no token: pass --token or set SNAPSHOT_KERNEL_TOKEN (--no-auth is "
                     "allowed only on a loopback address)")
    overrides = {f"display.max_{flag}": getattr(args, f"display_max_{flag}")
                 for flag in ("rows", "columns", "colwidth")
                 if getattr(args, f"display_max_{flag}") is not None}
    if args.server_id is not None:
        overrides["server.id"] = args.server_id
    if args.drain_s is not None:
        overrides["server.drain_s"] = args.drain_s
    settings = settings_of(args, overrides)
    setup_logging(settings["server.log_file"], args.verbose)
    # The zygote first: it starts (0.1 s) while this process imports the server (0.13 s),
    # and a restart's first cell need not wait for it.
    from snapkernel.kernel.server.pool import Pool
    pool = Pool(settings)
    pool.start()
    from snapkernel.api import server
    try:
        server.serve(host, int(port), settings, args.token, args.no_auth, pool)
    except server.StartFailed as exc:
        refuse(args, str(exc))


if __name__ == "__main__":
    main()
