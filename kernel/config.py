"""Configuration: the defaults in config.toml, overridden by a user file and flags."""

import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILE = os.path.join(ROOT, "config.toml")


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


def load(path=None, overrides=None):
    """Return the flat configuration {section.key: value}.

    Defaults come from the repository's config.toml; `path` overrides a
    subset; `overrides` ({"section.key": value}) wins over both. Unknown keys
    and values of the wrong type are refused, so a typo never goes unnoticed.
    """
    defaults = _read(DEFAULT_FILE)
    flat = {f"{s}.{k}": v for s, table in defaults.items() for k, v in table.items()}
    layers = []
    if path:
        user = _read(path)
        layers.append((path, {f"{s}.{k}": v for s, t in user.items()
                              if isinstance(t, dict) for k, v in t.items()}))
        bad = [s for s, t in user.items() if not isinstance(t, dict)]
        if bad:
            raise ConfigError(f"{path}: top-level key(s) {bad} must be inside a [section]")
    layers.append(("command line", overrides or {}))
    for origin, layer in layers:
        for key, value in layer.items():
            if key not in flat:
                raise ConfigError(f"{origin}: unknown setting {key!r}")
            want = type(flat[key])
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not want:
                raise ConfigError(f"{origin}: {key} must be {want.__name__}, not {value!r}")
            flat[key] = value
    if flat["store.durability"] not in ("sync", "async"):
        raise ConfigError("store.durability must be 'sync' or 'async'")
    if flat["store.remote"]:
        _check_remote(flat)
    if flat["workers.spare_after_quiet_s"] < 0:
        raise ConfigError("workers.spare_after_quiet_s must be 0 or more")
    if flat["display.figure_format"] not in ("png", "svg", "retina"):
        raise ConfigError("display.figure_format must be 'png', 'svg' or 'retina'")
    data_dir = flat["server.data_dir"]
    if not os.path.isabs(data_dir):
        base = os.path.dirname(os.path.abspath(path)) if path else ROOT
        flat["server.data_dir"] = os.path.join(base, data_dir)
    return flat


def _check_remote(flat):
    """Refuse remote settings that cannot work (before any server or worker starts)."""
    from storage.remote import RemoteError, parse_url
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
