"""What the graph cache shows: its listing, its recent misses and one entry's detail, as text and as HTML.

Every view is a plain value (a tuple of named rows, or a named tuple) that prints as a table in a terminal
(``repr``) and renders as a styled table in Jupyter (``_repr_html_``).  The HTML is self-contained: one
``<style>`` block scoped to the class ``cudnn-attn-cache``, every cell escaped.
"""

from __future__ import annotations

import html
from typing import NamedTuple, Sequence

STYLE = """<style>
.cudnn-attn-cache { font-family: system-ui, sans-serif; font-size: 13px; margin: 0.4em 0 1em 0; }
.cudnn-attn-cache p.summary { margin: 0 0 0.4em 0; font-weight: 600; }
.cudnn-attn-cache table { border-collapse: collapse; }
.cudnn-attn-cache caption { text-align: left; font-weight: 600; padding: 0.3em 0; }
.cudnn-attn-cache th { background: #2f4f6f; color: #fff; text-align: left; padding: 4px 10px; }
.cudnn-attn-cache td { padding: 3px 10px; border-bottom: 1px solid #d8dee4; vertical-align: top; }
.cudnn-attn-cache tbody tr:nth-child(even) { background: #f3f6f9; }
.cudnn-attn-cache td.num { text-align: right; font-variant-numeric: tabular-nums; }
.cudnn-attn-cache td.code { font-family: ui-monospace, monospace; white-space: nowrap; }
.cudnn-attn-cache td.failed { color: #a40000; }
.cudnn-attn-cache pre { max-height: 24em; overflow: auto; background: #f6f8fa; padding: 0.5em; font-size: 12px; }
</style>"""


def block(inner: str) -> str:
    """``inner`` HTML inside the styled container."""
    return f'{STYLE}<div class="cudnn-attn-cache">{inner}</div>'


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], kinds: Sequence[str], caption: str = "") -> str:
    """An HTML table; ``kinds[i]`` is the CSS class of column ``i``'s cells (``"num"``, ``"code"`` or ``""``)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="{k}">{html.escape(c)}</td>' if k else f"<td>{html.escape(c)}</td>"
                                    for c, k in zip(row, kinds)) + "</tr>" for row in rows)
    title = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return f"<table>{title}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The same table in plain text: columns padded, a rule under the headers."""
    every = [tuple(headers), *map(tuple, rows)]
    widths = [max(len(row[i]) for row in every) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in every]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# -- the listing -------------------------------------------------------------------------------------------------

class _Listing(tuple):
    """A tuple of rows that prints as a text table and renders as an HTML one; a subclass names its columns
    (``_HEADERS``, their CSS ``_KINDS``), the text shown when empty and the caption, and formats the cells."""

    _HEADERS: tuple[str, ...] = ()
    _KINDS: tuple[str, ...] = ()
    _EMPTY = ""
    _CAPTION = ""

    def _cells(self) -> list[tuple[str, ...]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return text_table(self._HEADERS, self._cells()) if self else self._EMPTY

    def _repr_html_(self) -> str:
        return block(self.html_table())

    def html_table(self) -> str:
        return table(self._HEADERS, self._cells(), self._KINDS, caption=self._CAPTION)


class CacheRow(NamedTuple):
    """One cached graph, as listed by :meth:`GraphCache.entries` (least recently used first).  ``index`` is the
    entry's number (``#``): given in build order, kept for the entry's life, what ``dump`` and ``entry_detail``
    take.  ``held`` counts the compiled JAX programs' call sites that run this entry's plan."""

    index: int
    kind: str
    features: str
    shapes: str
    device: int
    plan: str
    workspace_bytes: int
    build_seconds: float
    hits: int
    held: int = 0


class CacheListing(_Listing):
    """The rows of :meth:`GraphCache.entries`: a tuple of :class:`CacheRow` that prints as a table."""

    _EMPTY = "graph cache: empty"
    _CAPTION = "cached graphs, least recently used first"

    _HEADERS = ("#", "kind", "features", "shapes (Q K V O)", "dev", "plan", "workspace", "build s", "hits", "JAX")
    _KINDS = ("num", "", "", "code", "num", "code", "num", "num", "num", "num")

    def _cells(self) -> list[tuple[str, ...]]:
        return [(str(r.index), r.kind, r.features, r.shapes, str(r.device), r.plan, size(r.workspace_bytes),
                 f"{r.build_seconds:.3f}", str(r.hits), str(r.held)) for r in self]



# -- the misses ---------------------------------------------------------------------------------------------------

class MissRow(NamedTuple):
    """One lookup that missed, as listed by :meth:`GraphCache.misses` (oldest first).

    ``number`` is the entry it built (``None`` when the build failed); ``changes`` the fields in which its key
    differs from the nearest cached entry ``nearest`` at the time (``()``, ``None``: nothing was cached);
    ``evicted`` whether this very key had been cached and was evicted; ``outcome`` ``"built"``, ``"loaded"`` (from
    the plan store) or ``"failed"``, with ``error`` then; ``seconds`` the build (or load) time."""

    number: int | None
    kind: str
    features: str
    changes: tuple[str, ...]
    nearest: int | None
    evicted: bool
    outcome: str
    seconds: float
    error: str = ""

    @property
    def cause(self) -> str:
        """Why it missed: ``"T 1024→1025 differs from entry #3"``, ``"evicted earlier ..."``, ``"nothing cached"``."""
        if self.evicted:
            return "was cached, evicted earlier (least recently used)"
        if self.nearest is None:
            return "nothing cached"
        return f"{', '.join(self.changes) or 'no field'} differs from entry #{self.nearest}"

    @property
    def reason(self) -> str:
        """The cause and what the miss cost: ``"T 1024→1025 differs from entry #3; built 0.41 s"``."""
        cost = f"{self.outcome} {self.seconds:.2f} s"
        if self.error:
            cost += f": {self.error}"
        return f"{self.cause}; {cost}"


class MissListing(_Listing):
    """The rows of :meth:`GraphCache.misses`: a tuple of :class:`MissRow` that prints as a table."""

    _EMPTY = "no misses"
    _CAPTION = "recent misses, oldest first"

    _HEADERS = ("#", "kind", "features", "why it missed", "outcome", "s")
    _KINDS = ("num", "", "", "", "", "num")

    def _cells(self) -> list[tuple[str, ...]]:
        return [("-" if r.number is None else str(r.number), r.kind, r.features, r.cause,
                 r.outcome + (f": {r.error}" if r.error else ""), f"{r.seconds:.3f}") for r in self]



# -- one entry ----------------------------------------------------------------------------------------------------

class EntryDetail(NamedTuple):
    """Everything about one cached graph (:meth:`GraphCache.entry_detail`).  ``origin`` is ``"built"`` or
    ``"loaded"`` (from the plan store); ``held_by`` names the compiled JAX programs' call sites that run its
    plan; ``graph`` is cuDNN's JSON of the graph (what ``dump`` returns)."""

    number: int
    kind: str
    features: str
    shapes: str
    device: int
    plan: str
    engine: str
    workspace_bytes: int
    build_seconds: float
    origin: str
    hits: int
    held_by: tuple[str, ...]
    graph: str

    def _named(self) -> list[tuple[str, str]]:
        return [("entry", f"#{self.number}"), ("kind", self.kind), ("features", self.features),
                ("shapes (Q K V O)", self.shapes), ("device", str(self.device)), ("plan", self.plan),
                ("engine", self.engine), ("workspace", size(self.workspace_bytes)),
                ("build s", f"{self.build_seconds:.3f}"), ("origin", self.origin), ("hits", str(self.hits)),
                ("held by JAX", "; ".join(self.held_by) or "no compiled JAX program")]

    def __repr__(self) -> str:
        width = max(len(name) for name, _ in self._named())
        lines = [f"{name.ljust(width)}  {value}" for name, value in self._named()]
        return "\n".join([*lines, "graph (cuDNN JSON):", self.graph])

    def _repr_html_(self) -> str:
        fields = table(("field", "value"), self._named(), ("", "code"), caption=f"graph cache entry #{self.number}")
        graph = f"<details open><summary>graph (cuDNN JSON)</summary><pre>{html.escape(self.graph)}</pre></details>"
        return block(fields + graph)
