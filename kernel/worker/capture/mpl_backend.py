"""The matplotlib backend of cells: Agg drawing, figures shown as cell outputs.

Selected by figures.py as ``module://snapkernel.kernel.worker.capture.mpl_backend``.
`plt.show()` displays every open figure and closes it; the figures still
open when the cell ends are shown by the capture's finish_cell.
"""

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from snapkernel.kernel.worker.capture import figures


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

    def draw_idle(self, *args, **kwargs):
        """Nothing: an inline figure is drawn when it is shown. pyplot asks for a draw
        at every new figure (a wasted render) and as it loads a figure that was open
        (`fig` kept in a state), before the figure's axes are loaded (which failed)."""
