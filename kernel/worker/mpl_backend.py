"""The matplotlib backend of cells: Agg drawing, figures shown as cell outputs.

Selected by kernel.outputs as ``module://kernel.worker.mpl_backend``. `plt.show()`
displays every open figure and closes it; the figures still open when the
cell ends are shown by kernel.outputs.finish_cell.
"""

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg


class FigureManager(FigureManagerBase):
    """A figure manager whose show() puts the figure into the cell's outputs."""

    def show(self):
        """fig.show(): display this figure now (it stays open, as in Jupyter)."""
        from kernel.worker import outputs
        data, md = outputs.figure_bundle(self.canvas.figure, outputs.current_settings())
        outputs.publish(data, md)

    @classmethod
    def pyplot_show(cls, *, block=None):
        """plt.show(): display every open figure, then close them."""
        from kernel.worker import outputs
        outputs.show_figures(close=True)


class FigureCanvas(FigureCanvasAgg):
    """Agg canvas managed by FigureManager."""

    manager_class = FigureManager
