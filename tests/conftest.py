"""Fixtures: a real server process on a free port over a temporary store, gates, an S3
server. What they are made of, and every other helper the tests share, is in
tests/support/ (no test module imports another)."""

import pytest

from support.server import S3, Gate, Server


@pytest.fixture
def gate(tmp_path):
    """Make closed gates (`gate()` or `gate("name")`); all are opened at the test's end."""
    made = []

    def make(name="gate"):
        """A new closed gate."""
        made.append(Gate(tmp_path, name))
        return made[-1]

    yield make
    for one in made:
        one.open()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server per test module, on its own store."""
    srv = Server(tmp_path_factory.mktemp("store") / "data")
    yield srv
    srv.stop()


@pytest.fixture
def make_server(tmp_path):
    """Start servers on demand (stopped at the end of the test)."""
    started = []

    def make(data_dir=None, **kw):
        """A new server; on the same `data_dir` it resumes that store."""
        srv = Server(data_dir or tmp_path / f"data{len(started)}", **kw)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One S3 server per test module; the servers find dummy AWS credentials in the
    environment (moto accepts any)."""
    with pytest.MonkeyPatch.context() as env:
        for var in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            env.delenv(var, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = S3(tmp_path_factory.mktemp("s3") / "s3.log")
        yield server
        server.stop()
