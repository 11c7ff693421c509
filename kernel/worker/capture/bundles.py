"""MIME bundles made nbformat-valid and JSON-safe, and cut to size (ipykernel: jsonutil.py).

Whatever a `_repr_*_` method or `display(..., raw=True)` hands over (bytes,
lists of lines, numpy scalars in JSON, odd metadata) becomes what nbformat
v4 accepts: one string per text MIME type, one base64 string per binary
image, plain JSON for JSON types and metadata.
"""

import base64
import json

# MIME types whose value is base64 of binary data (one string, no newlines).
_BINARY_MIMES = ("image/png", "image/jpeg", "image/gif", "application/pdf")


def _is_json_mime(mime):
    """True for MIME types whose nbformat value is JSON, not a string."""
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def json_clean(value):
    """Return `value` as plain JSON types (unknown objects become their repr)."""
    try:
        return json.loads(json.dumps(value, default=repr))
    except (TypeError, ValueError):
        return repr(value)


def normalize_bundle(data, metadata):
    """Make a (data, metadata) pair nbformat-valid.

    Binary images become one base64 string without newlines; text MIME values
    become strings; JSON MIME values and metadata become plain JSON.
    """
    out = {}
    for mime, value in (data or {}).items():
        if not isinstance(mime, str) or value is None:
            continue
        if mime in _BINARY_MIMES:
            if isinstance(value, (bytes, bytearray, memoryview)):
                value = base64.b64encode(bytes(value)).decode("ascii")
            elif isinstance(value, str):
                value = "".join(value.split())
            else:
                continue
        elif _is_json_mime(mime):
            if isinstance(value, (bytes, str)):
                try:
                    value = json.loads(value)
                except ValueError:
                    value = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            value = json_clean(value)
        elif isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = "".join(value)
        elif not isinstance(value, str):
            value = str(value)
        out[mime] = value
    md = metadata if isinstance(metadata, dict) else {}
    md = json_clean(md) if md else {}
    if not isinstance(md, dict):
        md = {}
    return out, md


def entry_size(value):
    """Characters an output value takes (JSON values measured as JSON text)."""
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value))


def bundle_size(data):
    """Approximate bytes of a MIME bundle."""
    return sum(entry_size(v) for v in data.values())


def cap_bundle(data, max_chars):
    """Cut every MIME entry longer than `max_chars`, leaving a visible marker.

    Text is cut at the limit and ends with a note; binary images, SVG and JSON
    cannot be cut meaningfully, so they are dropped and the note goes into
    text/plain instead.
    """
    notes = []
    out = {}
    for mime, value in data.items():
        size = entry_size(value)
        if size <= max_chars:
            out[mime] = value
            continue
        note = (f"[output truncated: {mime} was {size:,} characters, more than "
                f"display.max_mime_chars={max_chars:,}]")
        if isinstance(value, str) and mime.startswith("text/"):
            sep = "<br>" if mime == "text/html" else "\n"
            out[mime] = value[:max_chars] + sep + note
            if mime == "text/plain":
                continue
        notes.append(note)
    if notes:
        plain = out.get("text/plain")
        out["text/plain"] = "\n".join([plain, *notes] if plain else notes)
    return out
