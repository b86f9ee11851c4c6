"""The graph cache's HTML views in a real headless browser (Chromium): the tables read back from the DOM the
browser built, the style the browser computed, and a screenshot.

``scripts/test.sh`` installs Chromium from the distribution's packages when it is missing and apt works; without a
browser the tests skip with the reason.  The cache here has a fake builder (no cuDNN): the views are the subject.
"""

from __future__ import annotations

import html.parser
import shutil
import subprocess
from pathlib import Path

import pytest

from cudnn_attn.core.config import AttentionConfig, StaticMask
from cudnn_attn.engine.cache import GraphCache, GraphKey

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SECONDS = 120               # a headless Chromium start takes 1-3 s on the 2-core CI host; this is the watchdog


def _browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(f"no headless browser here (none of {', '.join(BROWSERS)}); scripts/test.sh installs Chromium "
                "with apt where it can")


class Graph:
    def __init__(self, key: GraphKey, origin: str = "built"):
        self.plan_name, self.workspace_size, self.origin = "eng2_k24=7", 6 << 20, origin
        self.key = key

    def describe(self) -> str:
        return f'# {self.key.kind} {self.key.config.describe()}\n{{"nodes": [{{"name": "sdpa"}}]}}'


def _cache() -> GraphCache:
    """Three graphs built into a cache of two: a hit, a miss with a reason, an eviction, a JAX holder."""
    cache = GraphCache(maxsize=2, builder=lambda key: Graph(key, "loaded" if key.config.q_len == 2048 else "built"))
    base = AttentionConfig(batch=2, q_heads=16, kv_heads=16, q_len=1024, kv_len=1024, qk_dim=128, v_dim=128,
                           dtype="bfloat16", scale=128 ** -0.5, mask=StaticMask(right_bound=0))
    keys = [GraphKey(c, "fwd", 0, 91900) for c in (base, base.replace(q_len=1025, kv_len=1025),
                                                   base.replace(q_len=2048, kv_len=2048))]
    for key in (keys[0], keys[0], keys[1], keys[2], keys[0]):
        cache.entry(key)
    held = cache.entry(keys[0]).plan
    cache.add_holder(lambda: [(held, "JAX call site 0 on device 0: 1 live executable(s)")])
    return cache


# Reads what the browser computed back into the DOM (the headless browser runs the script before --dump-dom).
STYLE_PROBE = """<script>
const th = document.querySelector('.cudnn-attn-cache th'), num = document.querySelector('.cudnn-attn-cache td.num');
document.body.dataset.th = getComputedStyle(th).backgroundColor;
document.body.dataset.num = getComputedStyle(num).textAlign;
</script>"""


def _page(cache: GraphCache, tmp_path: Path) -> Path:
    page = tmp_path / "graph_cache.html"
    newest = cache.entries()[-1].index
    page.write_text(f'<!doctype html><html><head><meta charset="utf-8"><title>graph cache</title></head><body>'
                    f"{cache._repr_html_()}{cache.entry_detail(newest)._repr_html_()}{STYLE_PROBE}</body></html>",
                    encoding="utf-8")
    return page


def _run(browser: str, *arguments: str) -> subprocess.CompletedProcess:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--no-first-run", "--hide-scrollbars", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=SECONDS)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stderr[-2000:]}"
    return result


class Tables(html.parser.HTMLParser):
    """The tables of a DOM: caption, header cells, body rows of cell texts; and the body's data attributes."""

    def __init__(self):
        super().__init__()
        self.tables: list[dict] = []
        self.body: dict[str, str] = {}
        self._cell: list[str] | None = None
        self._caption = False

    def handle_starttag(self, tag, attrs):
        if tag == "body":
            self.body = {k[5:]: v for k, v in attrs if k.startswith("data-")}
        elif tag == "table":
            self.tables.append({"caption": "", "head": [], "rows": []})
        elif tag == "caption":
            self._caption = True
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "caption":
            self._caption = False
        elif tag in ("td", "th") and self._cell is not None:
            row = self.tables[-1]["rows"][-1]
            row.append("".join(self._cell))
            self._cell = None
        elif tag == "thead":
            self.tables[-1]["head"] = self.tables[-1]["rows"].pop()

    def handle_data(self, data):
        if self._caption:
            self.tables[-1]["caption"] += data
        elif self._cell is not None:
            self._cell.append(data)


def test_the_browser_reads_the_tables_and_applies_the_style(tmp_path):
    browser = _browser()
    cache = _cache()
    dom = _run(browser, "--dump-dom", _page(cache, tmp_path).as_uri()).stdout
    parsed = Tables()
    parsed.feed(dom)
    entries, misses, detail = parsed.tables
    assert entries["caption"] == "cached graphs, least recently used first"
    assert entries["head"][:3] == ["#", "kind", "features"] and entries["head"][-1] == "JAX"
    assert [(row[0], row[-2], row[-1]) for row in entries["rows"]] == [("2", "0", "0"), ("3", "1", "1")]
    assert entries["rows"][0][6] == "6.0 MiB" and entries["rows"][0][5] == "eng2_k24=7 (loaded)"
    assert misses["caption"] == "recent misses, oldest first"
    reasons = [row[3] for row in misses["rows"]]
    assert reasons[:3] == ["nothing cached", "T 1024→1025, S 1024→1025 differs from entry #0",
                           "T 1025→2048, S 1025→2048 differs from entry #1"]
    assert reasons[3] == "was cached, evicted earlier (least recently used)"
    fields = dict(detail["rows"])
    assert detail["caption"] == "graph cache entry #3"
    assert fields["held by JAX"] == "JAX call site 0 on device 0: 1 live executable(s)"
    assert (fields["engine"], fields["origin"], fields["hits"]) == ("engine 2", "built", "1")
    assert '"name": "sdpa"' in dom
    assert parsed.body == {"th": "rgb(47, 79, 111)", "num": "right"}, parsed.body


def test_the_screenshot_is_a_page(tmp_path):
    """A PNG of the page (look at it: ``CUDNN_ATTN_SCREENSHOT=path`` keeps it)."""
    import os

    browser = _browser()
    shot = Path(os.environ.get("CUDNN_ATTN_SCREENSHOT") or tmp_path / "graph_cache.png")
    _run(browser, f"--screenshot={shot}", "--window-size=1500,1100", _page(_cache(), tmp_path).as_uri())
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1500, 1100) and len(data) > 20_000, (width, height, len(data))
