"""The snapshot Jupyter kernel: each executed cell makes a new state of the session.

A wrapper kernel (ipykernel's Kernel base class) and a client of the
server over HTTP: it holds no namespace. A cell runs from the session's
head state into a new state and, on success, moves the head there; a
failing or crashing cell leaves the head where it was. Outputs reach the
front end as the server streams them. Interrupts arrive as messages and
become /interrupt. Completion and inspection run in a worker on the head
state (introspect.py); the kernel's own magics run here (magics.py).
"""

import asyncio
import base64
import os
import platform
import threading
import uuid

from ipykernel._version import kernel_protocol_version
from ipykernel.kernelbase import Kernel
from traitlets import Unicode

from snapkernel.kernel import __version__, protocol
from snapkernel.kernel import config as config_mod
from snapkernel.frontends.jupyter import introspect, iopub, magics
from snapkernel.frontends.jupyter.backend import backend
from snapkernel.api.client import ServerError
from snapkernel.frontends.jupyter.sessions import Sessions


class SnapshotKernel(Kernel):
    """Runs cells on the snapshot server, one new state per cell."""

    implementation = "snapshot-kernel"
    implementation_version = __version__
    language = "python"
    language_version = platform.python_version()
    language_info = {
        "name": "python", "version": platform.python_version(), "mimetype": "text/x-python",
        "file_extension": ".py", "pygments_lexer": "ipython3",
        "codemirror_mode": {"name": "ipython", "version": 3}, "nbconvert_exporter": "python",
    }
    spec_name = Unicode("snapshot", config=True,
                        help="The kernelspec's name: it names the private store")
    config_file = Unicode("", config=True,
                          help="A TOML file overriding config.toml (kernel and server)")

    def __init__(self, **kwargs):
        """Find or start the server; resume the session."""
        super().__init__(**kwargs)
        self.settings = config_mod.load(self.config_file or None)
        self.backend = backend(self.spec_name, self.settings, self.config_file or None)
        self.sessions = Sessions(self.backend.sessions_folder)
        self.magics = magics.Magics(self.sessions, self._describe)
        self.session_name = os.environ.get("JPY_SESSION_NAME") or self._default_session()
        self.execution_count = self.sessions.load(self.session_name).next - 1
        self.client = None
        self.running = None  # the exec_id of the cell on the server, for interrupts
        self.startup_error = None
        # One change of the session's head at a time (a cell, a front end's comm message).
        self.advancing = threading.Lock()
        self.comms = {}  # comm id -> target name, of the comms open with the front end
        for msg_type in protocol.COMM_MESSAGES:
            self.shell_handlers[msg_type] = self.comm_message
        try:
            self._connect()
        except ServerError as exc:
            self.startup_error = str(exc)

    def _default_session(self):
        """A session per kernel id: kept across restarts, which keep the connection file."""
        connection_file = getattr(self.parent, "connection_file", "")
        stem = os.path.splitext(os.path.basename(connection_file))[0]
        return stem or f"kernel-{os.getpid()}"

    @property
    def kernel_info(self):
        """ipykernel's, without "debugger": debugpy cannot reach the cells' processes,
        and the base class's look for it imports debugpy, which prints its frozen-modules
        warning into a terminal's `jupyter console`."""
        features = ["kernel subshells"] if getattr(self, "_supports_kernel_subshells",
                                                   False) else []
        return {"protocol_version": kernel_protocol_version,
                "implementation": self.implementation,
                "implementation_version": self.implementation_version,
                "language_info": self.language_info, "banner": self.banner,
                "help_links": self.help_links, "supported_features": features}

    @property
    def banner(self):
        """What the front end shows on connecting."""
        text = (f"Python {platform.python_version()} on the snapshot kernel "
                f"{self.implementation_version}: every cell makes a new state.\n"
                f"Session {self.session_name!r}, head: {self.magics.where(self.session_name)}; "
                f"store: {self.backend.where}\n"
                f"Kernel magics: %states, %undo [N], %checkout CELL|NAME, %branch NAME, "
                f"%session [NAME]\n")
        if self.startup_error:
            text += f"The server is not available: {self.startup_error}\n"
        return text

    # The server ---------------------------------------------------------------

    def _connect(self):
        """Find or start the server."""
        self.client = self.backend.connect()
        self.startup_error = None

    def _server_call(self, call):
        """`call(client)`, connecting first; once more after finding or starting the
        server again when the first try found no server listening (nothing was sent)."""
        if self.client is None:
            self._connect()
        # A fleet's load balancer keeps the session on the server that holds its head live.
        self.client.affinity = self.session_name
        try:
            return call(self.client)
        except ServerError as exc:
            if not exc.refused:
                raise
        self._connect()
        self.client.affinity = self.session_name
        return call(self.client)

    def _describe(self, name):
        """GET /states/NAME (None when there is no such state)."""
        return self._server_call(lambda c: c.describe(name))

    # Execution ----------------------------------------------------------------

    async def do_execute(self, code, silent, store_history=True, user_expressions=None,
                         allow_stdin=False, *, cell_meta=None, cell_id=None):
        """Run a cell (in a thread: the HTTP exchange blocks)."""
        return await asyncio.to_thread(self._execute, code, silent)

    def _execute(self, code, silent):
        """The execute_reply content of one cell."""
        try:
            calls = magics.parse(code)
            if calls is not None:
                return self._run_magics(calls)
            if silent:
                return self._run_silent(code)
            return self._run_cell(code)
        except magics.UsageError as exc:
            return self._fail("UsageError", str(exc), silent)
        except ServerError as exc:
            return self._fail(exc.etype, str(exc), silent)

    def _ok(self):
        """A successful execute_reply."""
        return {"status": "ok", "execution_count": self.execution_count, "payload": [],
                "user_expressions": {}}

    def _fail(self, ename, evalue, silent, traceback=None, shown=False):
        """A failed execute_reply, its error shown to the front end unless `shown`."""
        error = {"ename": ename, "evalue": evalue,
                 "traceback": traceback if traceback is not None else [f"{ename}: {evalue}"]}
        if not (silent or shown):
            self.send_response(self.iopub_socket, "error", error)
        return dict(error, status="error", execution_count=self.execution_count)

    def _run_magics(self, calls):
        """Run the kernel's magics of a cell, one after the other."""
        for name, argument in calls:
            before = self.session_name
            text, self.session_name = self.magics.run(self.session_name, name, argument)
            self.send_response(self.iopub_socket, "stream", {"name": "stdout", "text": text})
            if self.session_name != before:
                # Cell numbers are the session's: %checkout N means its cell N.
                self.execution_count = self.sessions.load(self.session_name).next - 1
        return self._ok()

    def _run_silent(self, code):
        """A silent cell (a front end's own code): run on the head, store nothing, show nothing."""
        head = self.sessions.load(self.session_name).head
        exec_id = f"jupyter-{uuid.uuid4().hex}"
        self.running = exec_id
        try:
            answer = self._server_call(lambda c: c.evaluate(
                code, head, exec_id, timeout=0))
        finally:
            self.running = None
        if answer["error"]:
            return self._fail(answer["error"]["ename"], answer["error"]["evalue"], True)
        return self._ok()

    def _run_cell(self, code):
        """Run a cell from the head into a new state; move the head on success."""
        with self.advancing:
            with self.sessions.change(self.session_name) as session:
                n = max(self.execution_count, session.next)
                session.next = n + 1
            self.execution_count = n
            answer, relay = self._advance(code, session.head, session.state_name(n), n, code,
                                          self.get_parent("shell"))
        if answer.get("state_name"):
            return self._ok()
        error = answer["error"]
        if error["ename"] == "StateNotFound" and error["evalue"] == session.head:
            return self._fail("StateNotFound", f"the head of session {self.session_name!r}, "
                              f"state {session.head!r}, is no longer on the server: %checkout "
                              f"another cell or state, or %session NAME for a new session",
                              False)
        return self._fail(error["ename"], error["evalue"], False, error["traceback"],
                          relay.error_shown)

    def _advance(self, code, head, new_name, n, line, parent):
        """Run `code` from `head` into `new_name`, its outputs and comm messages relayed
        to the front end as replies to `parent` (whose msg_id the cell's process gives as
        its parent's: ipywidgets' Output captures by it); on success the session's head moves
        there (recorded as cell `n`, `line` its code). (the answer, the relay). The
        caller holds `advancing` from its reading of the head on."""
        exec_id = f"jupyter-{uuid.uuid4().hex}"

        def send(msg_type, content, metadata=None, buffers=None):
            """Publish one iopub message of this run (also from the flush timer's thread)."""
            self.session.send(self.iopub_socket, msg_type, content, parent,
                              ident=self._topic(msg_type), metadata=metadata, buffers=buffers)

        relay = iopub.OutputRelay(send, n, self.settings["jupyter.stream_flush_s"])
        answer = None
        self.running = exec_id
        try:
            events = self._server_call(
                # Jupyter starts a kernel in its notebook's folder: the cells run there.
                # The cell's In[n] is the kernel's count, not the head's + 1: a magic
                # counts, and %undo or %checkout moves the head back.
                lambda c: c.execute_streamed(code, exec_id, head, new_name, os.getcwd(),
                                             parent["header"].get("msg_id"), n))
            for event in events:
                if event["type"] == "output":
                    relay.output(event["output"])
                elif event["type"] == "clear_output":
                    relay.clear_output(event["wait"])
                elif event["type"] == "comm":
                    self._note_comm(event["msg_type"], event["content"])
                    relay.comm(event)
                elif event["type"] == "answer":
                    answer = event["answer"]
        finally:
            self.running = None
            relay.flush()
        if answer is None:
            raise ServerError("the server's answer ended before the cell did (did the server "
                              "stop?); run the cell again", "ServerUnreachable")
        if answer.get("state_name"):
            with self.sessions.change(self.session_name) as session:
                session.head = answer["state_name"]
                self.sessions.append(session, n, answer["state_name"], head, line)
        return answer, relay

    # Comms ----------------------------------------------------------------------

    def _note_comm(self, msg_type, content):
        """Keep the open comms' targets (comm_info_request) as comms open and close."""
        if msg_type == "comm_open":
            self.comms[content["comm_id"]] = content.get("target_name", "")
        elif msg_type == "comm_close":
            self.comms.pop(content.get("comm_id"), None)

    async def comm_message(self, stream, ident, parent):
        """comm_open, comm_msg or comm_close from the front end (a slider moved): handled
        in the process of the session's head, which makes a new state, the head's next."""
        await asyncio.to_thread(self._deliver_comm, parent)

    def _deliver_comm(self, parent):
        """comm_message's work (a thread: the HTTP exchange blocks)."""
        msg_type, content = parent["header"]["msg_type"], parent["content"]
        try:
            code = protocol.comm_cell(msg_type, content, parent.get("metadata"),
                                      [base64.b64encode(bytes(b)).decode()
                                       for b in parent.get("buffers") or ()])
            self._note_comm(msg_type, content)
            with self.advancing:
                session, n = self.sessions.load(self.session_name), self.execution_count
                name = session.state_name(f"{n}.{msg_type}-{uuid.uuid4().hex[:12]}")
                answer, _ = self._advance(code, session.head, name, n,
                                          f"# {msg_type} from the front end", parent)
        except (ServerError, TypeError, ValueError) as exc:  # (not JSON: TypeError)
            self.log.error("The front end's %s was not handled: %s", msg_type, exc)
            return
        error = answer["error"]
        if error and error["ename"] == "CommNotHandled":
            self.log.debug("The front end's %s: %s", msg_type, error["evalue"])
        elif error:
            self.log.error("The front end's %s failed in the kernel: %s: %s", msg_type,
                           error["ename"], error["evalue"])

    async def comm_info_request(self, stream, ident, parent):
        """The comms open between the cells' processes and the front end."""
        target = parent["content"].get("target_name")
        comms = {comm_id: {"target_name": name} for comm_id, name in self.comms.items()
                 if target is None or name == target}
        self.session.send(stream, "comm_info_reply", {"status": "ok", "comms": comms},
                          parent, ident)

    async def interrupt_request(self, stream, ident, parent):
        """Stop the running cell through /interrupt (the kernel itself gets no signal)."""
        content = {"status": "ok"}
        exec_id = self.running
        if exec_id is not None and self.client is not None:
            try:
                await asyncio.to_thread(self.client.interrupt, exec_id)
            except ServerError as exc:
                content = {"status": "error", "ename": exc.etype, "evalue": str(exc),
                           "traceback": []}
        self.session.send(stream, "interrupt_reply", content, parent, ident=ident)

    async def do_shutdown(self, restart):
        """Stop a running cell and stop counting as a user of the server."""
        if self.running is not None and self.client is not None:
            try:
                await asyncio.to_thread(self.client.interrupt, self.running)
            except ServerError:
                pass  # the server is gone: nothing runs there any more
        self.backend.close()
        return {"status": "ok", "restart": restart}

    # Introspection --------------------------------------------------------------

    def _head(self):
        """The current session's head state."""
        return self.sessions.load(self.session_name).head

    async def do_complete(self, code, cursor_pos):
        """Completions from the head state's namespace."""
        if cursor_pos is None:
            cursor_pos = len(code)
        return await asyncio.to_thread(introspect.complete, self.client, self._head(), code,
                                       cursor_pos, self.settings["jupyter.introspect_timeout_s"])

    async def do_inspect(self, code, cursor_pos, detail_level=0, omit_sections=()):
        """IPython's inspector on the head state's namespace."""
        return await asyncio.to_thread(
            introspect.inspect_object, self.client, self._head(), code, cursor_pos,
            detail_level, omit_sections, self.settings["jupyter.introspect_timeout_s"])

    async def do_is_complete(self, code):
        """IPython's verdict on whether `code` is a complete cell (no namespace needed)."""
        from IPython.core.inputtransformer2 import TransformerManager
        status, indent = TransformerManager().check_complete(code)
        reply = {"status": status}
        if status == "incomplete":
            reply["indent"] = " " * indent
        return reply


def main():
    """Start the kernel (the kernelspec's command)."""
    from ipykernel.kernelapp import IPKernelApp
    IPKernelApp.launch_instance(kernel_class=SnapshotKernel)
