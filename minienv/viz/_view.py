"""What every minienv view shares: shown live in a kernel, as a static picture everywhere else.

A view owns one ipywidgets/plotly widget (``self.widget``) for its whole life and updates it in place. Displaying
the view displays that widget; ``static()`` renders the current state as HTML (or SVG) for readers without a
kernel — GitHub and nbviewer strip widget state, so the notebooks show both.
"""

from __future__ import annotations

from typing import Any

from . import _style as S


class View:
    """Base of the live views: subclasses set ``self.widget`` and implement ``to_html()``.

    A displayed view puts ``css_class`` on its live widget and on those of the views inside it (``parts()``), so a
    page can be checked for every view it should show (the browser tier counts them against the ``text/plain``
    repr, which names the parts).
    """

    widget: Any
    css_class = "minienv-view"

    def parts(self) -> list["View"]:
        """This view and every view it contains (composites override it)."""
        return [self]

    def tag_widgets(self) -> None:
        """Put each part's ``css_class`` on its live widget (a no-op for widgets without DOM classes)."""
        for view in self.parts():
            add_class = getattr(view.widget, "add_class", None)
            if add_class is not None and view.css_class not in getattr(view.widget, "_dom_classes", ()):
                add_class(view.css_class)

    def to_html(self) -> str:  # pragma: no cover - every subclass defines it
        raise TypeError(f"{type(self).__name__} must define to_html()")

    def static(self):
        """A static picture of the current state for readers without a kernel (GitHub, nbviewer)."""
        return S.require("IPython.display").HTML(self.to_html())

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        self.tag_widgets()
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs) or {})
        bundle["text/plain"] = repr(self)
        return bundle


class SvgView(View):
    """A view whose static picture is one SVG drawing (``to_svg()``), wrapped in a ``<div class=css_class>``."""

    def to_svg(self) -> str:  # pragma: no cover - every subclass defines it
        raise TypeError(f"{type(self).__name__} must define to_svg()")

    def to_html(self) -> str:
        return f'<div class="{self.css_class}">{self.to_svg()}</div>'

    def static(self):
        """A static picture of the current state for readers without a kernel (GitHub, nbviewer)."""
        return S.require("IPython.display").SVG(data=self.to_svg())
