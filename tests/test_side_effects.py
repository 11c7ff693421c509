"""Keeping a state never acts on the world: the files a cell wrote are exactly what it
wrote once its answer came, after a restart and through `run`, with the file objects
(and sockets, processes, connections) back inert (storage/handles.py, storage/guard.py).

Each idiom is a cell that writes files in a folder of its own, leaving its file
objects in the namespace as notebooks do, and ends printing the SHA-256 of every
file in its folder (binding no name): what it wrote. A check is an expression read
after a restore, with the value it must show.
"""

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys

import nbformat
import pytest

from support.server import ROOT, TOKEN, Server

DIGESTS = ("print('DIGESTS', __import__('json').dumps({p: __import__('hashlib').sha256("
           "open(p, 'rb').read()).hexdigest() for p in sorted(__import__('os').listdir('.'))"
           " if not p.endswith(('.py', '.ipynb')) and __import__('os').path.isfile(p)}))")

# id: (cell, check expression after a restore, what it shows, inert_symbols of the state)
IDIOMS = {
    "open_w": ("with open('plain.txt', 'w') as f:\n    f.write('hello\\n' * 100)",
               "f.closed, f.name, f.mode", "(True, 'plain.txt', 'w')", []),
    "open_wb": ("with open('plain.bin', 'wb') as fb:\n    fb.write(bytes(range(256)) * 4)",
                "fb.closed, fb.name, fb.mode", "(True, 'plain.bin', 'wb')", []),
    "csv_writer": ("import csv\nwith open('table.csv', 'w', newline='') as fc:\n"
                   "    writer = csv.writer(fc)\n"
                   "    writer.writerows([i, i * i] for i in range(50))",
                   "fc.closed, fc.name, type(writer).__name__",
                   "(True, 'table.csv', 'writer')", []),
    "pathlib": ("import pathlib\nwith pathlib.Path('path.txt').open('w') as fp:\n"
                "    fp.write('via pathlib\\n' * 20)",
                "fp.closed, fp.name, fp.mode", "(True, 'path.txt', 'w')", []),
    "logging_w": ("import logging\nhandler = logging.FileHandler('run.log', mode='w')\n"
                  "log = logging.getLogger('idiom')\nlog.addHandler(handler)\n"
                  "log.warning('first record')",
                  "os.path.basename(handler.baseFilename), handler.stream, handler.mode",
                  "('run.log', None, 'a')", []),
    "tarfile_w": ("import tarfile\nwith open('member.txt', 'w') as fm:\n"
                  "    fm.write('in the archive\\n')\n"
                  "with tarfile.open('archive.tar', 'w') as tar:\n    tar.add('member.txt')",
                  "tar.closed, [m.name for m in tar.members], tar.fileobj.closed, fm.closed",
                  "(True, ['member.txt'], True, True)", []),
    "gzip_wb": ("import gzip\nwith gzip.open('data.gz', 'wb') as gz:\n"
                "    gz.write(b'compressed ' * 100)",
                "gz.closed, gz.name", "(True, 'data.gz')", []),
    "zipfile_w": ("import zipfile\nwith zipfile.ZipFile('files.zip', 'w') as zf:\n"
                  "    zf.writestr('a.txt', 'zipped\\n' * 10)",
                  "zf.fp, zf.filename, zf.namelist()", "(None, 'files.zip', ['a.txt'])", []),
    "append_log": ("with open('append.log', 'a') as fa:\n    fa.write('appended\\n')",
                   "fa.closed, fa.name, fa.mode", "(True, 'append.log', 'a')", []),
    "tempfiles": ("import tempfile\n"
                  "named = tempfile.NamedTemporaryFile(dir='.', suffix='.tmp')\n"
                  "named.write(b'temporary\\n')\nnamed.flush()\n"
                  "anon = tempfile.TemporaryFile()\nanon.write(b'unnamed')\nanon.flush()",
                  "named.closed, open(named.name, 'rb').read(), anon.closed",
                  "(True, b'temporary\\n', True)", ["anon", "named"]),
    "read_midway": ("with open('lines.txt', 'w') as out:\n"
                    "    out.writelines(f'line {i}\\n' for i in range(10))\n"
                    "reader = open('lines.txt')\nfirst = reader.readline()",
                    "reader.closed, reader.name, reader.readline()",
                    "(False, 'lines.txt', 'line 1\\n')", []),
    "left_open_w": ("g = open('left.txt', 'w')\ng.write('kept\\n' * 10)\ng.flush()",
                    "g.closed, g.name, g.mode", "(True, 'left.txt', 'w')", ["g"]),
}


def digests(folder):
    """{file: SHA-256} of the files of `folder`, as the cells' DIGESTS line says them."""
    return {p: hashlib.sha256((folder / p).read_bytes()).hexdigest()
            for p in sorted(os.listdir(folder))
            if not p.endswith((".py", ".ipynb")) and (folder / p).is_file()}


def written(outputs):
    """The {file: SHA-256} a cell printed on its DIGESTS line."""
    text = "".join(o.get("text", "") for o in outputs)
    return json.loads(text.split("DIGESTS ", 1)[1].splitlines()[0])


@pytest.fixture(scope="module")
def restored(tmp_path_factory):
    """Every idiom run through /execute, each from `initial` in its folder, then the
    server restarted on the same store: (server, {id: (folder, answer, the folder's
    digests once answered)})."""
    root = tmp_path_factory.mktemp("idioms")
    made = {}
    srv = Server(root / "data")
    try:
        for name, (cell, *_) in IDIOMS.items():
            folder = root / name
            folder.mkdir()
            answer = srv.execute(f"{cell}\n{DIGESTS}", new=name, extra={"cwd": str(folder)})
            made[name] = (folder, answer, digests(folder))
    finally:
        srv.stop()
    srv = Server(root / "data")
    yield srv, made
    srv.stop()


@pytest.mark.parametrize("name", list(IDIOMS))
def test_a_written_file_is_what_the_cell_wrote_after_its_answer_and_a_restart(restored, name):
    srv, made = restored
    folder, answer, answered = made[name]
    _, check, shows, inert = IDIOMS[name]
    wrote = written(answer["output"])
    assert wrote and all(wrote.values())
    assert answered == wrote  # the save before the answer truncated some
    assert answer["inert_symbols"] == inert
    back = srv.execute(f"import os\nprint(repr(({check})))", state=name)
    assert "".join(o["text"] for o in back["output"]) == shows + "\n"
    assert digests(folder) == wrote  # after the restore


def test_a_state_lists_what_a_restore_gives_back_closed(restored):
    srv, _ = restored
    assert srv.get("/states/left_open_w").json()["inert"] == {
        "g": ["file 'left.txt' open in mode 'w': restored closed, never reopened"]}
    assert srv.get("/states/open_w").json()["inert"] == {}


def test_a_file_read_midway_that_changed_comes_back_closed_and_said(make_server, tmp_path):
    data = tmp_path / "store"
    srv = make_server(data)
    (tmp_path / "lines.txt").write_text("one\ntwo\n")
    srv.execute("reader = open('lines.txt')\nfirst = reader.readline()", new="r",
                extra={"cwd": str(tmp_path)})
    srv.stop()
    (tmp_path / "lines.txt").write_text("changed\n")
    again = make_server(data)
    back = again.execute("print(reader.closed, reader.name)", state="r")
    text = "".join(o["text"] for o in back["output"])
    assert "True lines.txt\n" in text
    assert "reader: file 'lines.txt'" in text and "changed since the state was saved" in text
    assert (tmp_path / "lines.txt").read_text() == "changed\n"


# The `run` command ---------------------------------------------------------------------

def idioms_notebook(path, readback=False):
    """A notebook of every idiom (one cell each, in the notebook's folder), with
    `readback` one more reading every check."""
    sources = [f"{cell}\n{DIGESTS}" for cell, *_ in IDIOMS.values()]
    if readback:
        sources.append("import os\n" + "\n".join(
            f"print({name!r}, repr(({check})))" for name, (_, check, *_) in IDIOMS.items()))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s, id=f"c{n}") for n, s in enumerate(sources)]
    nbformat.write(nb, str(path))


def run_cli(*args):
    """`python main.py run ARGS`; the CompletedProcess, text output."""
    return subprocess.run([sys.executable, "main.py", "run", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def cell_text(path, index):
    """What the code cell at `index` of a notebook file printed."""
    cells = nbformat.read(str(path), as_version=4).cells
    return "".join(o.get("text", "") for o in cells[index].outputs)


def first_written(path):
    """{file: SHA-256} as the idiom cells of a run notebook wrote them: each cell prints
    its folder's files, the earlier cells' as they were by then too."""
    wrote = {}
    for index in range(len(IDIOMS)):
        for file, digest in written([{"text": cell_text(path, index)}]).items():
            wrote.setdefault(file, digest)
    return wrote


@pytest.mark.parametrize("how", ["serverless", "server"])
def test_run_keeps_what_the_cells_wrote_and_reads_the_objects_back(make_server, tmp_path,
                                                                   how):
    folder = tmp_path / "nb"
    folder.mkdir()
    src = folder / "idioms.ipynb"
    data = tmp_path / "store"
    srv = make_server(data) if how == "server" else None
    where = ("--server", srv.url, "--token", TOKEN) if srv else ("--data-dir", data)
    idioms_notebook(src)
    first = run_cli(src, *where)
    assert first.returncode == 0, first.stderr
    wrote = first_written(src)
    assert digests(folder) == wrote
    if srv:
        srv.stop()
        srv = make_server(data)
        where = ("--server", srv.url, "--token", TOKEN)
    # The cells are reused; the last one runs on their states restored from the store.
    idioms_notebook(src, readback=True)
    second = run_cli(src, *where)
    assert second.returncode == 0, second.stderr
    assert second.stderr.count(": reused") == len(IDIOMS), second.stderr
    shown = cell_text(src, len(IDIOMS)).splitlines()
    assert shown == [f"{name} {shows}" for name, (_, _, shows, _) in IDIOMS.items()]
    assert digests(folder) == wrote


# The structural test --------------------------------------------------------------------

# A module of the notebook's: imported by a cell, and again by every restore of its states
# before any value loads, it records in `events` what acts on the world.
PROBE = '''
import os
import sys

events = []
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_ALWAYS = {"os.remove", "os.rmdir", "os.rename", "os.truncate", "shutil.rmtree",
           "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
           "os.kill", "os.killpg", "socket.bind"}


def _record(event, args):
    if event == "open":
        path, mode, flags = args
        if not (isinstance(path, int) or (mode and any(c in mode for c in "wax+"))
                or flags & _WRITING):
            return
    elif event == "socket.connect":
        if not isinstance(args[1], tuple):  # the worker's own channel: a Unix socket
            return
    elif event == "sqlite3.connect":
        if args[0] == ":memory:":
            return
    elif event == "mmap.__new__":
        if args[0] == -1:
            return
    elif event not in _ALWAYS:
        return
    events.append(f"{event} {args!r}")


sys.addaudithook(_record)
'''

# Every kind of handle, open and closed; the last line forgets what the cell itself did.
HANDLES = """\
import csv, gzip, logging, mmap, multiprocessing, pathlib, socket, sqlite3, subprocess
import sys, tarfile, tempfile, zipfile
with open('closed.txt', 'w') as closed_w:
    closed_w.write('closed\\n' * 10)
with open('closed.bin', 'wb') as closed_wb:
    closed_wb.write(b'closed')
open_w = open('open.txt', 'w')
open_w.write('open\\n')
open_w.flush()
open_a = open('append.txt', 'a')
open_a.write('appended\\n')
open_a.flush()
open_rw = open('closed.bin', 'r+b')
open_r = open('closed.txt')
open_r.readline()
with open('closed.csv', 'w', newline='') as csv_file:
    csv.writer(csv_file).writerow([1, 2])
    writer = csv.writer(csv_file)
open_csv = open('open.csv', 'w', newline='')
open_writer = csv.writer(open_csv)
open_writer.writerow([3, 4])
open_csv.flush()
path_w = pathlib.Path('path.txt').open('w')
handler = logging.FileHandler('run.log', mode='w')
logging.getLogger('probed').addHandler(handler)
logging.getLogger('probed').warning('a record')
with tarfile.open('closed.tar', 'w') as tar:
    tar.add('closed.txt')
open_tar = tarfile.open('open.tar', 'w')
open_tar.add('closed.txt')
with gzip.open('closed.gz', 'wb') as gz:
    gz.write(b'gz')
open_gz = gzip.open('open.gz', 'wt')
with zipfile.ZipFile('closed.zip', 'w') as zf:
    zf.writestr('a.txt', 'zipped')
open_zip = zipfile.ZipFile('open.zip', 'w')
open_zip.writestr('a.txt', 'zipped')
named = tempfile.NamedTemporaryFile(dir='.', suffix='.tmp')
named.write(b'named')
named.flush()
anon = tempfile.TemporaryFile()
tempdir = tempfile.TemporaryDirectory(dir='.')
listener = socket.socket()
listener.bind(('127.0.0.1', 0))
listener.listen()
client = socket.create_connection(listener.getsockname())
process = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'],
                           stdout=subprocess.PIPE)
done = subprocess.Popen([sys.executable, '-c', 'pass'])
done.wait()
db = sqlite3.connect('data.db')
cursor = db.execute('create table t (x)')
db.commit()
with open('mapped.bin', 'wb') as out:
    out.write(b'm' * 4096)
mapped_file = open('mapped.bin', 'r+b')
mapped = mmap.mmap(mapped_file.fileno(), 0)
pipe_a, pipe_b = multiprocessing.Pipe()
print('PID', process.pid)
""" + DIGESTS + "\nprobe.events.clear()"

# What the restored handles are: (expression, what it shows).
RESTORED = [
    ("closed_w.closed, closed_w.name, closed_w.mode", "(True, 'closed.txt', 'w')"),
    ("closed_wb.closed, open_w.closed, open_a.closed, open_rw.closed", "(True, True, True, True)"),
    ("open_r.closed, open_r.readline()", "(False, 'closed\\n')"),
    ("csv_file.closed, open_csv.closed, type(open_writer).__name__", "(True, True, 'writer')"),
    ("path_w.closed, handler.stream, handler.mode", "(True, None, 'a')"),
    ("tar.closed, open_tar.closed, open_tar.fileobj.closed", "(True, True, True)"),
    ("gz.closed, open_gz.closed, zf.fp, open_zip.fp", "(True, True, None, None)"),
    ("named.closed, anon.closed, os.path.isdir(tempdir.name)", "(True, True, True)"),
    ("listener.fileno(), client.fileno()", "(-1, -1)"),
    ("process.returncode, process.stdout.closed, done.returncode", "(None, True, 0)"),
    ("mapped.closed, mapped_file.closed, pipe_a.closed, pipe_b.closed",
     "(True, True, True, True)"),
]


def test_saving_and_restoring_a_state_of_every_handle_never_acts_on_the_world(
        make_server, tmp_path):
    """An audit hook in the workers (the notebook's own module) records every event
    that acts on the world while the state's values are saved and, after a restart,
    restored; there must be none, and each handle comes back inert."""
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "probe.py").write_text(PROBE)
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import probe", new="p0", extra={"cwd": str(folder)})
    made = srv.execute(HANDLES, state="p0", new="p1")
    out = "".join(o["text"] for o in made["output"])
    pid = int(out.split("PID ")[1].split()[0])
    try:
        saved = srv.execute("print(probe.events)", state="p1")
        assert saved["output"][0]["text"] == "[]\n"  # while saving p1
        wrote = written(made["output"])
        assert digests(folder) == wrote
        assert made["inert_symbols"] == sorted([
            "open_w", "open_a", "open_rw", "open_csv", "open_writer", "path_w", "open_tar",
            "open_gz", "open_zip", "named", "anon", "client", "listener", "process", "db",
            "cursor", "mapped", "mapped_file", "pipe_a", "pipe_b"])
        srv.stop()
        again = make_server(data)
        checks = "\n".join(f"print(repr(({expr})))" for expr, _ in RESTORED)
        back = again.execute(f"import os, sqlite3\n{checks}\nprint(probe.events)\n"
                             f"try:\n    db.execute('select 1')\n"
                             f"except sqlite3.ProgrammingError as closed:\n"
                             f"    print('db:', closed)", state="p1")
        shown = "".join(o["text"] for o in back["output"]).splitlines()
        assert shown[:len(RESTORED)] == [shows for _, shows in RESTORED]
        assert shown[len(RESTORED):] == ["[]", "db: Cannot operate on a closed database."]
        assert digests(folder) == wrote
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone with its worker, or not yet
            os.kill(pid, signal.SIGKILL)


def test_a_value_whose_load_would_act_is_refused_rather_than_run(make_server, tmp_path):
    """Values whose pickles act when loaded: one the C pickler takes (its load after a
    restart is refused, naming what it would do; the other variables load) and one only
    dill takes (its trial load is refused: it is volatile, made again by its cell)."""
    (tmp_path / "victim.txt").write_text("precious\n")
    (tmp_path / "victim2.txt").write_text("precious too\n")
    data = tmp_path / "store"
    srv = make_server(data)
    folder = {"cwd": str(tmp_path)}
    srv.execute("class Truncates:\n"
                "    def __reduce__(self):\n"
                "        return (open, ('victim.txt', 'w'))\n"
                "t = Truncates()\nkept = 42", new="truncates", extra=folder)
    made = srv.execute("import os, threading\n"
                       "class Removes:\n"
                       "    def __reduce__(self):\n"
                       "        return (os.remove, ('victim2.txt',), {'l': threading.Lock()})\n"
                       "r = Removes()", new="removes", extra=folder)
    assert made["volatile_symbols"] == ["r"]
    srv.stop()
    again = make_server(data)
    assert again.execute("print(kept)", state="truncates")["output"][0]["text"] == "42\n"
    refused = again.execute("t", state="truncates", ok=False)["error"]
    assert refused["ename"] == "SideEffect" and "open('victim.txt', 'w'" in refused["evalue"]
    assert again.value("removes", "type(r).__name__") == "'Removes'"
    assert (tmp_path / "victim.txt").read_text() == "precious\n"
    assert (tmp_path / "victim2.txt").read_text() == "precious too\n"


def test_hdf5_and_netcdf_handles_come_back_closed_their_files_untouched(make_server,
                                                                         tmp_path):
    """Their C libraries open files unseen by audit hooks, and neither pickles: a
    volatile handle's cell, replayed, made the file again ('w'), losing what later cells
    wrote to it."""
    h5py = pytest.importorskip("h5py")
    pytest.importorskip("netCDF4")
    folder = tmp_path / "nb"
    folder.mkdir()
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("import h5py, netCDF4\nh5 = h5py.File('data.h5', 'w')\nh5['x'] = [1, 2, 3]\n"
                "nc = netCDF4.Dataset('data.nc', 'w')\nnc.createDimension('t', 3)",
                new="h1", extra={"cwd": str(folder)})
    made = srv.execute("h5['y'] = [4, 5]\nh5.flush()\nnc.createDimension('u', 2)\nnc.sync()",
                       state="h1", new="h2")
    assert made["inert_symbols"] == ["h5", "nc"]
    wrote = digests(folder)
    srv.stop()
    again = make_server(data)
    back = again.execute("print(bool(h5), nc.isopen())", state="h2")
    assert back["output"][0]["text"] == "False False\n"
    assert digests(folder) == wrote
    with h5py.File(folder / "data.h5", "r") as f:
        assert sorted(f) == ["x", "y"]


def test_replaying_a_volatile_value_never_rewrites_a_file(make_server, tmp_path):
    """A volatile value is made again by replaying its cell; a cell that also wrote a
    file would write it again (the user may have changed it since): the replay runs
    sealed, so the value cannot be made again and the answer says why; the file is as
    the user left it, and the state's other values load."""
    data = tmp_path / "store"
    srv = make_server(data)
    srv.execute("with open('report.txt', 'w') as f:\n    f.write('first\\n')\n"
                "squares = (n * n for n in range(3))\nkept = 7", new="wrote",
                extra={"cwd": str(tmp_path)})
    srv.stop()
    (tmp_path / "report.txt").write_text("edited by the user\n")
    again = make_server(data)
    assert again.execute("print(kept)", state="wrote")["output"][0]["text"] == "7\n"
    refused = again.execute("next(squares)", state="wrote", ok=False)["error"]
    assert "squares" in refused["evalue"] and "report.txt" in refused["evalue"], refused
    assert (tmp_path / "report.txt").read_text() == "edited by the user\n"
