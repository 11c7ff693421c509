"""Web pages cannot use the server: a page of another origin, and a name rebound to it.

A browser lets any page POST to any address: a plain HTML form with a
text/plain body that looks like JSON, a `no-cors` fetch, and, once a name of
the attacker's resolves to this machine (DNS rebinding), same-origin requests
of any kind. Headless Chromium tries each against a real server, with
`--no-auth` and with the token in the page's URLs; the proof is what the
server did (no cell ran: no file written, no state made, none reset), not
only what it answered. api/guard.py says what is checked.
"""

import http.server
import json
import shutil
import threading

import pytest
import requests

from support.server import TOKEN, wait_for

ATTACKER = "attacker.example"  # a page of another origin (mapped to 127.0.0.1 below)
REBOUND = "rebound.example"  # a name the attacker made resolve to this machine


def cell(marker, name):
    """The body of an /execute that writes `marker` and makes state `name`."""
    return {"code": f"open({str(marker)!r}, 'w').write('ran')", "exec_id": name,
            "state_name": "initial", "new_state_name": name}


class Page(http.server.BaseHTTPRequestHandler):
    """Serves the attacker's page: the HTML it is given."""

    html = b""

    def do_GET(self):
        """The page."""
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.html)))
        self.end_headers()
        self.wfile.write(self.html)

    def log_message(self, *args):
        """Quiet."""


@pytest.fixture
def browser():
    """Headless Chromium that resolves the attacker's names to 127.0.0.1."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("Debian's chromium and chromium-driver are not installed "
                    "(apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--host-resolver-rules=MAP {ATTACKER} 127.0.0.1, MAP {REBOUND} 127.0.0.1"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    chrome.set_script_timeout(60)
    yield chrome
    chrome.quit()


@pytest.fixture
def attacker():
    """An HTTP server of another origin serving Page.html; its port."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("auth", ["no-auth", "token"])
def test_pages_of_other_origins_and_rebound_names_run_nothing(make_server, browser, attacker,
                                                             tmp_path, auth):
    srv = (make_server(token=None, extra_args=["--no-auth"]) if auth == "no-auth"
           else make_server())
    query = "" if auth == "no-auth" else f"?token={TOKEN}"
    srv.execute("kept = 1", new="kept")
    markers = {how: tmp_path / f"{how}.ran" for how in ("form", "fetch", "rebound")}

    # 1. A plain HTML form, submitted by the page: its text/plain body is JSON
    # ("NAME=VALUE", with the JSON split across the two).
    body = json.dumps(cell(markers["form"], "by-form"))
    name, value = body[:-1] + ', "pad": "', '"}'
    Page.html = (f'<form id="f" method="POST" enctype="text/plain" '
                 f'action="{srv.url}/execute{query}"><input type="hidden" '
                 f"name='{name}' value='{value}'></form>"
                 f'<script>document.getElementById("f").submit()</script>').encode()
    browser.get(f"http://{ATTACKER}:{attacker}/form")
    wait_for(lambda: browser.current_url.startswith(srv.url), "the form to be submitted")

    # 2. no-cors fetches from the page: a cell, and /reset without a body.
    Page.html = b"<p>nothing to see</p>"
    browser.get(f"http://{ATTACKER}:{attacker}/fetch")
    done = browser.execute_async_script("""
        const [url, body, done] = arguments;
        Promise.allSettled([
            fetch(url + "/execute" + QUERY, {method: "POST", mode: "no-cors", body: body}),
            fetch(url + "/reset" + QUERY, {method: "POST", mode: "no-cors"}),
        ]).then(r => done(r.map(x => x.status)));
    """.replace("QUERY", json.dumps(query)), srv.url, json.dumps(cell(markers["fetch"],
                                                                       "by-fetch")))
    assert done == ["fulfilled", "fulfilled"], done  # sent (their answers are opaque)

    # 3. DNS rebinding: a page of the rebound name, the server's own port, sends what a
    # same-origin page may: JSON bodies, DELETE, and reads of the answers.
    browser.get(f"http://{REBOUND}:{srv.port}/health")
    answers = browser.execute_async_script("""
        const [body, done] = arguments;
        const json = {"Content-Type": "application/json"};
        Promise.all([
            fetch("/execute" + QUERY, {method: "POST", headers: json, body: body}),
            fetch("/states/kept" + QUERY, {method: "DELETE"}),
            fetch("/states" + QUERY),
        ]).then(rs => Promise.all(rs.map(r => r.text().then(t => [r.status, t]))))
          .then(done);
    """.replace("QUERY", json.dumps(query)), json.dumps(cell(markers["rebound"], "by-rebound")))
    for status, text in answers:
        assert status == 403 and json.loads(text)["error"]["type"] == "Forbidden", answers
        assert "kept" not in text  # nothing of the server's read

    # What the server did: nothing. No cell ran, no state was made, deleted or reset.
    assert not [m for m in markers.values() if m.exists()]
    assert srv.get("/states").json()["states"] == ["initial", "kept"]
    assert srv.value("kept", "kept") == "1"
    # The same requests from a script (no Origin, the server's own Host) still work.
    r = requests.post(f"{srv.url}/execute{query}", json=cell(markers["fetch"], "by-script"),
                      timeout=60)
    assert r.status_code == 200 and r.json()["error"] is None and markers["fetch"].exists()
