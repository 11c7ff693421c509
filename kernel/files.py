"""Files a run writes: staged beside their destination, then renamed into place.

A staged file is complete and on disk before it gets its final name, so a
reader of the destination sees the old file, or none, or the whole new one,
never a half-written one, whatever happens to the run in between.
"""

import hashlib
import os
import tempfile


def sha256_file(path):
    """Hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def unwritable(path, what):
    """Why no file can be written at `path` (`what` names it in the message), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"cannot write the {what} {path}: its folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"cannot write the {what} {path}: its folder {folder} is not writable"
    if os.path.isdir(path):
        return f"the {what} {path} is a folder"
    return None


def stage(dest, data):
    """Write `data` (bytes) to a new hidden file beside `dest`; returns its path.

    Its mode is what writing `dest` with open() would leave: the mode of the
    file there, or the umask's for a new one (mkstemp makes 0600).
    """
    folder = os.path.dirname(os.path.abspath(dest))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dest)}.", suffix=".tmp",
                               dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = os.stat(dest).st_mode & 0o7777
        except FileNotFoundError:
            mask = os.umask(0)
            os.umask(mask)
            mode = 0o666 & ~mask
        os.chmod(tmp, mode)
    except BaseException:
        discard(tmp)
        raise
    return tmp


def promote(tmp, dest, overwrite):
    """Give the staged file `tmp` its name `dest`.

    Without `overwrite`, FileExistsError if `dest` exists, even if it appeared
    after the run started: a hard link never replaces a file.
    """
    if overwrite:
        os.replace(tmp, dest)
    else:
        try:
            os.link(tmp, dest)
        finally:
            discard(tmp)
    folder = os.open(os.path.dirname(os.path.abspath(dest)), os.O_RDONLY)
    try:
        os.fsync(folder)  # the new name is on disk too
    finally:
        os.close(folder)


def discard(tmp):
    """Remove a staged file (if it is still there)."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
