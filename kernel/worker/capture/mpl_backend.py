"""The matplotlib backend of cells: Agg drawing, figures shown as cell outputs.

Selected by figures.py as ``module://kernel.worker.capture.mpl_backend``.
`plt.show()` displays every open figure and closes it; the figures still
open when the cell ends are shown by the capture's finish_cell.
"""

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kernel.worker.capture import figures


class FigureManager(FigureManagerBase):
    """A figure manager whose show() puts the figure into the cell's outputs."""

    def show(self):
        """fig.show(): display this figure now (it stays open, as in Jupyter)."""
        figures.show_figure(self.canvas.figure)

    @classmethod
    def pyplot_show(cls, *, block=None):
        """plt.show(): display every open figure, then close them."""
        figures.show_figures(close=True)


class FigureCanvas(FigureCanvasAgg):
    """Agg canvas managed by FigureManager."""

    manager_class = FigureManager
    inline = True  # its figures are the cell's outputs (figures.show_figures)


def new_figure_manager(num, *args, FigureClass=Figure, **kwargs):
    """A new figure and its manager (pyplot.figure). Defined here so that pyplot takes
    this module's draw_if_interactive instead of its own, which draws."""
    return FigureCanvas.new_manager(FigureClass(*args, **kwargs), num)


def draw_if_interactive():
    """Nothing: a figure is drawn when it is shown, as with ipykernel's inline backend.
    pyplot's own would draw it whole at plt.figure() and twice more in a pandas plot
    (about 25 ms a draw on this workload's plots)."""
