"""Configuration: the defaults in config.toml (at the top of the package), overridden by
a user file and flags."""

import importlib.resources
import os
import tomllib

# Settings that name a file or folder: a relative one is resolved where it was given.
PATH_SETTINGS = ("server.data_dir", "server.log_file", "server.certfile", "server.keyfile",
                 "server.trace_file")


class ConfigError(ValueError):
    """A configuration file or value that cannot be used."""


def _read(path):
    """Parse one TOML file, naming the file in any error."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def defaults_text():
    """The text of the defaults file, config.toml in this package (installed with it)."""
    return importlib.resources.files("snapkernel").joinpath("config.toml").read_text("utf-8")


def default_data_dir():
    """The store used when none is configured: snapshot-kernel/store in the user's data
    folder ($XDG_DATA_HOME, else ~/.local/share; a relative XDG_DATA_HOME is ignored,
    as the XDG Base Directory specification says)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "snapshot-kernel", "store")


def data_dir_help():
    """What a --data-dir flag's help says of its default: the folder itself."""
    return (f"default: server.data_dir of --config if it sets one, else "
            f"{default_data_dir()}")


def load(path=None, overrides=None):
    """Return the flat configuration {section.key: value}.

    Defaults come from the package's config.toml; `path` overrides a subset;
    `overrides` ({"section.key": value}) wins over both. Unknown keys and
    values of the wrong type are refused, so a typo never goes unnoticed.
    A relative path setting is relative to the folder of the file that gave
    it, or to the working directory when given in `overrides`; an empty
    server.data_dir is default_data_dir().
    """
    defaults = tomllib.loads(defaults_text())
    flat = {f"{s}.{k}": v for s, table in defaults.items() for k, v in table.items()}
    base = {}  # path setting -> the folder its relative value is relative to
    layers = []
    if path:
        user = _read(path)
        layers.append((path, os.path.dirname(os.path.abspath(path)),
                       {f"{s}.{k}": v for s, t in user.items()
                        if isinstance(t, dict) for k, v in t.items()}))
        bad = [s for s, t in user.items() if not isinstance(t, dict)]
        if bad:
            raise ConfigError(f"{path}: top-level key(s) {bad} must be inside a [section]")
    layers.append(("command line", os.getcwd(), overrides or {}))
    for origin, folder, layer in layers:
        for key, value in layer.items():
            if key not in flat:
                raise ConfigError(f"{origin}: unknown setting {key!r}")
            want = type(flat[key])
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not want:
                raise ConfigError(f"{origin}: {key} must be {want.__name__}, not {value!r}")
            flat[key] = value
            base[key] = folder
    if flat["store.durability"] not in ("sync", "async"):
        raise ConfigError("store.durability must be 'sync' or 'async'")
    if flat["store.remote"]:
        _check_remote(flat)
    for key in ("workers.spare_after_quiet_s", "workers.chain_step_s", "server.drain_s"):
        if flat[key] < 0:
            raise ConfigError(f"{key} must be 0 or more")
    if flat["server.max_header_kb"] < 1:
        raise ConfigError("server.max_header_kb must be 1 or more")
    for key in ("server.allowed_hosts", "server.allowed_origins"):
        if not all(isinstance(item, str) for item in flat[key]):
            raise ConfigError(f"{key} must be a list of strings")
    if flat["display.figure_format"] not in ("png", "svg", "retina"):
        raise ConfigError("display.figure_format must be 'png', 'svg' or 'retina'")
    for key in PATH_SETTINGS:
        if flat[key] and not os.path.isabs(flat[key]):
            flat[key] = os.path.join(base.get(key, os.getcwd()), flat[key])
    if not flat["server.data_dir"]:
        flat["server.data_dir"] = default_data_dir()
    return flat


def _check_remote(flat):
    """Refuse remote settings that cannot work (before any server or worker starts)."""
    from snapkernel.storage.remote import RemoteError, parse_url
    try:
        parse_url(flat["store.remote"])
    except RemoteError as exc:
        raise ConfigError(str(exc)) from None
    if not 0 < flat["store.cache_gb"] < flat["store.max_store_gb"]:
        raise ConfigError("store.cache_gb must be more than 0 and less than max_store_gb")
    for key in ("remote_timeout_s", "remote_refresh_s", "remote_list_wait_s",
                "remote_retry_s", "remote_grace_hours"):
        if flat[f"store.{key}"] < 0:
            raise ConfigError(f"store.{key} must be 0 or more")
    for key in ("remote_attempts", "remote_parallel"):
        if flat[f"store.{key}"] < 1:
            raise ConfigError(f"store.{key} must be 1 or more")
