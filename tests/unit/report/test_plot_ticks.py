"""#44 item 1: every log axis of `kvtier report` printed raw mathtext (`$\\mathdefault{10^{3}}$`) once mathtext
was switched off for outside text. Log axes are now labelled in plain text, and outside text stays inert."""

from __future__ import annotations

from kvtier.report.plots import _plt, _png


def _labels(ax, which: str) -> list[str]:  # type: ignore[no-untyped-def]
    axis = ax.yaxis if which == "y" else ax.xaxis
    return [t.get_text() for t in axis.get_ticklabels(minor=False) + axis.get_ticklabels(minor=True) if t.get_text()]


def test_log_axes_are_labelled_in_plain_text_and_outside_text_stays_inert():
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.plot([1, 2, 3], [1.0, 30.0, 4000.0], label="$\\frac{a}{b}$ device")  # a device name with a dollar in it
    a.set_yscale("log")
    b.plot([0.5, 20.0, 900.0], [0.2, 0.3, 0.5])
    b.set_xscale("log")
    b.set_yscale("log")  # a narrow span: minor ticks get labels too
    a.set_title("$x$ label")
    a.set_ylabel("latency, ms")
    a.legend()
    png = _png(fig)
    assert png.startswith(b"\x89PNG")
    labels = _labels(a, "y") + _labels(b, "x") + _labels(b, "y")
    assert labels and not [x for x in labels if "$" in x or "mathdefault" in x], labels
    assert {"10", "1000"} <= set(_labels(a, "y")), _labels(a, "y")
    assert a.get_title() == "$x$ label" and a.title.get_parse_math() is False  # printed as written, not parsed
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    r = FigureCanvasAgg(fig).get_renderer()  # the figure was closed after it was saved
    assert a.yaxis.label.get_window_extent(r).x0 >= 0  # the axis's name is on the image, left of "1000"
