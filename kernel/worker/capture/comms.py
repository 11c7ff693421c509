"""Comms: the messages of ipywidgets and `tqdm.auto` between a cell and the front end
(ipykernel: comm/, ipkernel.py's `_create_comm`).

A worker has no connection to a front end: what its comms send (comm_open,
comm_msg, comm_close) are items of the running cell's stream, next to its
outputs and in their order, and the Jupyter kernel relays them on iopub
while the cell runs (a progress bar moves). Outside a streamed cell (a
restore, a notebook run) they go nowhere; the model's state is kept in the
state all the same (kernel/worker/widgets.py).

A message from the front end (a slider moved) runs as a cell of its own,
`deliver(...)`, whose code kernel/protocol.py `comm_cell` writes: it is
handled by this process's comm manager, in the process of the state the
kernel's session is at, and its effects make a new state like any cell's.

While a cell of the Jupyter kernel runs, its comms' `kernel` stands in for
ipykernel's kernel to ipywidgets' `Output`: its `get_parent()` gives the
front end's message the cell answers (protocol.Execute's `message_id`).
`with out:` sets the widget's msg_id to that message's id, and JupyterLab
moves the outputs the kernel relays as replies to that message into the
widget (ipykernel: `Kernel.get_parent`).

The comm package's `create_comm` and `get_comm_manager` are replaced as
soon as it is imported (and again after ipykernel's, which replaces them
too); `tqdm.autonotebook` picks the widget bar, as it does in a kernel.
"""

import base64
import contextlib
import json
import sys

from snapkernel.kernel.protocol import COMM_MESSAGES
from snapkernel.kernel.worker.capture import collector

_manager = None  # this process's CommManager, made on first use (inherited by forks)
_parent_id = None  # the id of the front end's message the running cell answers


@contextlib.contextmanager
def answering(message_id):
    """While a cell runs: `message_id` (None: no front end's message) is its parent's."""
    global _parent_id
    _parent_id = message_id
    try:
        yield
    finally:
        _parent_id = None


class _KernelStandIn:
    """What ipywidgets' Output asks of ipykernel's kernel: the parent message."""

    @staticmethod
    def get_parent():
        """The front end's message the running cell answers ({} when none)."""
        if _parent_id is None:
            return {}
        return {"header": {"msg_id": _parent_id}}


KERNEL = _KernelStandIn()


def install():
    """Make comm's create_comm and get_comm_manager ours (comm or ipykernel just imported)."""
    import comm
    comm.create_comm = create_comm
    comm.get_comm_manager = get_comm_manager


def get_comm_manager():
    """This process's comm manager: the comms open here and the targets registered."""
    global _manager
    if _manager is None:
        from comm.base_comm import CommManager
        _manager = CommManager()
    return _manager


def create_comm(*args, **kwargs):
    """A comm whose messages go to the running cell's stream."""
    return _comm_class()(*args, **kwargs)


_CellComm = None


def _comm_class():
    """The comm class, made once comm is imported (a worker need not import it)."""
    global _CellComm
    if _CellComm is None:
        from comm.base_comm import BaseComm

        class CellComm(BaseComm):
            """A comm whose messages are items of the running cell's stream."""

            kernel = KERNEL

            def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
                """Send one message to the front end, through the running cell."""
                content = dict(keys, data={} if data is None else data, comm_id=self.comm_id)
                collector.send_comm({
                    "type": "comm", "msg_type": msg_type, "content": content,
                    "metadata": metadata or {},
                    "buffers": [base64.b64encode(bytes(b)).decode() for b in buffers or ()]})

            def __reduce_ex__(self, protocol):
                """A comm lives in its process: a value holding one that is not rebuilt
                from its model state (kernel/worker/widgets.py) is volatile."""
                raise TypeError(f"comm {self.comm_id} is a live connection to the front end")

        _CellComm = CellComm
    return _CellComm


class CommNotHandled(Exception):
    """No comm or target of this process takes the front end's message: the cell that
    carried it fails, so it makes no state (the head stays)."""


def deliver(msg_type, message):
    """Hand a message from the front end (`message`: the JSON of {content, metadata,
    buffers}, buffers base64) to this process's comm manager, as ipykernel does.

    A comm_open for a target nobody registered is answered with comm_close, as
    ipykernel answers it, then CommNotHandled; so is a message for a comm this
    process does not have.
    """
    from snapkernel.kernel.worker.capture import libraries  # (it imports this module)
    message = json.loads(message)
    if msg_type not in COMM_MESSAGES:
        raise ValueError(f"not a comm message: {msg_type!r}")
    if libraries.awaited("ipywidgets"):
        # A restored state's widgets are rebuilt as ipywidgets is imported.
        __import__("ipywidgets")
    msg = {"header": {"msg_type": msg_type}, "content": message["content"],
           "metadata": message.get("metadata") or {},
           "buffers": [base64.b64decode(b) for b in message.get("buffers") or ()]}
    manager = get_comm_manager()
    content = msg["content"]
    if msg_type == "comm_open":
        known = content["target_name"] in manager.targets
    else:
        known = content["comm_id"] in manager.comms
    if known:
        getattr(manager, msg_type)(None, None, msg)
        return
    if msg_type == "comm_open":
        # ipykernel's answer to an unknown target (without its log line on stderr).
        comm = create_comm(comm_id=content["comm_id"], primary=False,
                           target_name=content["target_name"])
        manager.register_comm(comm)
        comm.close()
    raise CommNotHandled(f"no comm or target here for the front end's {msg_type} "
                         f"({content.get('target_name') or content.get('comm_id')})")


def notebook_tqdm():
    """`tqdm.autonotebook` (and so `tqdm.auto`) just imported: use the widget bar, as
    in a kernel (it looks for ipykernel's shell, which workers do not import)."""
    auto = sys.modules["tqdm.autonotebook"]
    try:
        from tqdm import notebook
    except ImportError:
        return
    if notebook.IProgress is not None:
        auto.tqdm, auto.trange = notebook.tqdm, notebook.trange
