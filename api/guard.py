"""Who may reach a route: the `Host` and `Origin` checks that keep web pages out.

A browser lets any page send a POST to any address, and a name the page's
site controls can be made to resolve to this machine (DNS rebinding), so the
token alone does not keep a page out of a server started with `--no-auth` or
one whose token a page learnt. As Jupyter's server does, a request passes if

- its `Host` names this server: `localhost`, a loopback address, the bind
  address, any IP address when the server is bound to all of them (0.0.0.0,
  ::), or a name in `server.allowed_hosts`. A rebound name is the attacker's
  own, so it is none of these; an IP address is never rebound.
- it has no `Origin` (scripts, curl, Plainbook: browsers send one on every
  cross-origin POST and every fetch), or its `Origin` is this server's own
  (its host and port are the `Host`), or is listed in `server.allowed_origins`.

"*" in either list turns that check off. docs/api.md says more.
"""

import ipaddress
import urllib.parse

WILDCARDS = ("0.0.0.0", "::", "")


def _address(name):
    """The IP address `name` spells (brackets of IPv6 dropped), else None."""
    try:
        return ipaddress.ip_address(name.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _host_name(host):
    """The name of a Host header without its port, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host, bind_host, allowed_hosts):
    """True if a request whose Host header is `host` names this server."""
    if "*" in allowed_hosts:
        return True
    name = _host_name(host)
    address = _address(name)
    bind = _host_name(bind_host or "")
    if address is not None:
        return address.is_loopback or address == _address(bind) or bind.strip("[]") in WILDCARDS
    return name in ("localhost", bind) or name in {h.lower() for h in allowed_hosts}


def origin_allowed(origin, host, allowed_origins):
    """True if a request whose Origin header is `origin` (None: none) may be answered."""
    if origin is None or "*" in allowed_origins:
        return True
    origin = origin.strip().lower().rstrip("/")
    if origin in {o.lower().rstrip("/") for o in allowed_origins}:
        return True
    netloc = urllib.parse.urlsplit(origin).netloc
    return bool(netloc) and netloc == host.strip().lower()


def refusal(environ, bind_host, allowed_hosts, allowed_origins):
    """The message refusing a request (WSGI `environ`) that a web page may have sent;
    None when it may go on."""
    host = environ.get("HTTP_HOST")
    if host is not None and not host_allowed(host, bind_host, allowed_hosts):
        return (f"the Host {host!r} does not name this server (a web page whose name was "
                f"made to point here?); reach it as localhost or by its address, or add "
                f"the name to server.allowed_hosts in the config file")
    origin = environ.get("HTTP_ORIGIN")
    if not origin_allowed(origin, host or "", allowed_origins):
        return (f"requests from web pages of another origin ({origin}) are refused; add "
                f"the origin to server.allowed_origins in the config file if that page "
                f"should use this server")
    return None
