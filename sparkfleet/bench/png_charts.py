"""Bar and line charts written as PNG with the standard library only (zlib + struct).

No plotting package is a dependency of sparkfleet (matplotlib is not in the controller venv),
and the charts a benchmark report needs are simple: grouped bars and lines over time, with
axes, ticks, grid lines, a legend and labels. Text uses a built-in 5x7 bitmap font (upper
case, digits and common punctuation; lower case is drawn as upper case), scaled 2x.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (30, 30, 30)
GRID: Color = (225, 225, 225)
AXIS: Color = (90, 90, 90)
PALETTE: list[Color] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
]

# 5x7 glyphs: seven rows, five bits each (bit 4 is the leftmost pixel).
GLYPHS: dict[str, tuple[int, ...]] = {
    "0": (0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E),
    "1": (0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "2": (0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F),
    "3": (0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E),
    "4": (0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02),
    "5": (0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E),
    "6": (0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E),
    "7": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08),
    "8": (0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E),
    "9": (0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C),
    "A": (0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "B": (0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E),
    "C": (0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E),
    "D": (0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C),
    "E": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F),
    "F": (0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10),
    "G": (0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F),
    "H": (0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11),
    "I": (0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E),
    "J": (0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C),
    "K": (0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11),
    "L": (0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F),
    "M": (0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11),
    "N": (0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11),
    "O": (0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "P": (0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10),
    "Q": (0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D),
    "R": (0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11),
    "S": (0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E),
    "T": (0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
    "U": (0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E),
    "V": (0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04),
    "W": (0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A),
    "X": (0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11),
    "Y": (0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04),
    "Z": (0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F),
    " ": (0, 0, 0, 0, 0, 0, 0),
    ".": (0, 0, 0, 0, 0, 0x0C, 0x0C),
    ",": (0, 0, 0, 0, 0x0C, 0x04, 0x08),
    "-": (0, 0, 0, 0x1F, 0, 0, 0),
    "_": (0, 0, 0, 0, 0, 0, 0x1F),
    "/": (0, 0x01, 0x02, 0x04, 0x08, 0x10, 0),
    ":": (0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0),
    "%": (0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03),
    "(": (0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02),
    ")": (0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08),
    "[": (0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E),
    "]": (0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E),
    "+": (0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0),
    "=": (0, 0, 0x1F, 0, 0x1F, 0, 0),
    "#": (0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A),
    "<": (0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02),
    ">": (0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08),
    "'": (0x04, 0x04, 0x08, 0, 0, 0, 0),
    "*": (0, 0x04, 0x15, 0x0E, 0x15, 0x04, 0),
    "?": (0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04),
    "!": (0x04, 0x04, 0x04, 0x04, 0x04, 0, 0x04),
    "|": (0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04),
}
GLYPH_W, GLYPH_H = 5, 7


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``width`` x ``height`` from row-major RGB bytes."""
    if len(rgb) != width * height * 3:
        raise ValueError(f"pixel buffer has {len(rgb)} bytes, expected {width * height * 3}")
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class Canvas:
    """An RGB pixel buffer with rectangles, lines and bitmap text."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            offset = (y * self.width + x) * 3
            self.pixels[offset : offset + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the rectangle with corners (x0, y0) and (x1, y1), inclusive."""
        x0, x1 = sorted((x0, x1))
        y0, y1 = sorted((y0, y1))
        x0, x1 = max(0, x0), min(self.width - 1, x1)
        y0, y1 = max(0, y0), min(self.height - 1, y1)
        if x0 > x1 or y0 > y1:
            return
        row = bytes(color) * (x1 - x0 + 1)
        for y in range(y0, y1 + 1):
            offset = (y * self.width + x0) * 3
            self.pixels[offset : offset + len(row)] = row

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thickness: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = thickness // 2
        while True:
            self.rect(x0 - half, y0 - half, x0 - half + thickness - 1, y0 - half + thickness - 1, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    @staticmethod
    def text_width(text: str, scale: int = 2) -> int:
        return max(0, len(text) * (GLYPH_W + 1) * scale - scale)

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> None:
        """Draw ``text`` with its top-left corner at (x, y)."""
        for index, char in enumerate(text.upper()):
            rows = GLYPHS.get(char, GLYPHS["?"])
            left = x + index * (GLYPH_W + 1) * scale
            for row_index, bits in enumerate(rows):
                for col in range(GLYPH_W):
                    if bits & (1 << (GLYPH_W - 1 - col)):
                        top = y + row_index * scale
                        self.rect(left + col * scale, top, left + col * scale + scale - 1, top + scale - 1, color)

    def text_centered(self, cx: int, y: int, text: str, color: Color = BLACK, scale: int = 2) -> None:
        """Centre ``text`` on x = cx, shifted inwards where it would leave the canvas."""
        width = self.text_width(text, scale)
        left = min(max(0, cx - width // 2), max(0, self.width - width))
        self.text(left, y, text, color, scale)

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.pixels)


def nice_ticks(low: float, high: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 x 10^k apart) covering [low, high]."""
    if not math.isfinite(low) or not math.isfinite(high):
        raise ValueError(f"axis range [{low}, {high}] is not finite")
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw_step = (high - low) / max(1, target)
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw_step)
    start = math.floor(low / step) * step
    ticks = []
    value = start
    while value < high + step * 0.999:
        ticks.append(round(value, 10))
        value += step
    return ticks


def format_number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 10000:
        return f"{value / 1000:.0f}K"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.3g}"
    return f"{value:.2g}"


def _fit(text: str, max_px: int, scale: int) -> str:
    while text and Canvas.text_width(text, scale) > max_px:
        text = text[:-2] + "." if len(text) > 2 else text[:-1]
    return text


class _Frame:
    """Plot area geometry shared by the chart kinds: title, y axis with ticks and grid, legend."""

    def __init__(
        self,
        canvas: Canvas,
        title: str,
        y_label: str,
        y_max: float,
        y_min: float = 0.0,
        legend: Sequence[str] = (),
    ) -> None:
        self.canvas = canvas
        self.ticks = nice_ticks(y_min, y_max)
        self.y_low, self.y_high = self.ticks[0], self.ticks[-1]
        label_w = max(Canvas.text_width(format_number(t)) for t in self.ticks)
        self.left = 16 + label_w + 8
        self.right = canvas.width - 20
        self.bottom = canvas.height - 70
        canvas.text_centered(canvas.width // 2, 12, _fit(title, canvas.width - 20, 2), BLACK, 2)
        # legend rows under the title (wrapping), then the y-axis label, then the plot area
        y = 38
        x = 16
        for index, name in enumerate(legend):
            item_w = Canvas.text_width(name) + 20
            if x > 16 and x + item_w > canvas.width - 16:
                x, y = 16, y + 22
            canvas.rect(x, y, x + 13, y + 13, PALETTE[index % len(PALETTE)])
            canvas.text(x + 20, y, name, BLACK, 2)
            x += item_w + 18
        if legend:
            y += 24
        canvas.text(16, y, _fit(y_label, canvas.width - 32, 2), AXIS, 2)
        self.top = y + 36
        for tick in self.ticks:
            tick_y = self.y_of(tick)
            canvas.line(self.left, tick_y, self.right, tick_y, GRID)
            text = format_number(tick)
            canvas.text(self.left - 8 - Canvas.text_width(text), tick_y - 7, text, AXIS, 2)
        canvas.line(self.left, self.top, self.left, self.bottom, AXIS, 2)
        canvas.line(self.left, self.bottom, self.right, self.bottom, AXIS, 2)

    def y_of(self, value: float) -> int:
        span = self.y_high - self.y_low or 1.0
        return round(self.bottom - (value - self.y_low) / span * (self.bottom - self.top))


def _framed(
    title: str,
    series: Sequence[tuple[str, Sequence[float | None]]],
    y_label: str,
    width: int,
    height: int,
    legend: bool,
) -> tuple[Canvas, _Frame]:
    """A canvas and its frame, the y axis spanning every finite value of series (and 0)."""
    values = [v for _, vals in series for v in vals if v is not None and math.isfinite(v)]
    canvas = Canvas(width, height)
    frame = _Frame(
        canvas,
        title,
        y_label,
        max(values) if values else 1.0,
        min(0.0, min(values, default=0.0)),
        [name for name, _ in series] if legend else [],
    )
    return canvas, frame


def bar_chart(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    y_label: str,
    width: int = 900,
    height: int = 460,
) -> bytes:
    """Grouped bars: one group per category, one bar per series, value printed above each bar."""
    if not categories or not series:
        raise ValueError("a bar chart needs at least one category and one series")
    canvas, frame = _framed(title, series, y_label, width, height, legend=len(series) > 1)
    group_w = (frame.right - frame.left) / len(categories)
    bar_w = max(2, int(group_w * 0.75 / len(series)))
    for cat_index, category in enumerate(categories):
        group_left = frame.left + cat_index * group_w + (group_w - bar_w * len(series)) / 2
        for series_index, (_, vals) in enumerate(series):
            value = vals[cat_index] if cat_index < len(vals) else None
            if value is None or not math.isfinite(value):
                continue
            x0 = int(group_left + series_index * bar_w)
            y = frame.y_of(value)
            zero = frame.y_of(max(0.0, frame.y_low))
            canvas.rect(x0 + 1, min(y, zero), x0 + bar_w - 2, max(y, zero) - 1, PALETTE[series_index % len(PALETTE)])
            label = format_number(value)
            label_scale = next((s for s in (2, 1) if Canvas.text_width(label, s) <= bar_w + 8), 0)
            if label_scale:
                top = min(y, zero) - 8 * label_scale - 2
                canvas.text_centered(x0 + bar_w // 2, top, label, BLACK, label_scale)
        cx = int(frame.left + (cat_index + 0.5) * group_w)
        canvas.text_centered(cx, frame.bottom + 10, _fit(category, int(group_w) - 4, 2), BLACK, 2)
    return canvas.png()


def line_chart(
    title: str,
    x_labels: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    y_label: str,
    width: int = 900,
    height: int = 460,
) -> bytes:
    """Lines with point markers over ordered x positions (e.g. runs over time)."""
    if not x_labels or not series:
        raise ValueError("a line chart needs at least one x position and one series")
    canvas, frame = _framed(title, series, y_label, width, height, legend=True)
    count = len(x_labels)
    step = (frame.right - frame.left - 40) / max(1, count - 1)

    def x_of(index: int) -> int:
        return int(frame.left + 20 + index * step) if count > 1 else (frame.left + frame.right) // 2

    label_px = max(Canvas.text_width(label) for label in x_labels) + 16
    label_every = max(1, math.ceil(count / max(1, (frame.right - frame.left) // label_px)))
    for index, label in enumerate(x_labels):
        x = x_of(index)
        canvas.line(x, frame.bottom, x, frame.bottom + 5, AXIS)
        if index % label_every == 0:
            canvas.text_centered(x, frame.bottom + 12, _fit(label, 200, 2), BLACK, 2)
    for series_index, (_, vals) in enumerate(series):
        color = PALETTE[series_index % len(PALETTE)]
        previous: tuple[int, int] | None = None
        for index, value in enumerate(vals):
            if value is None or not math.isfinite(value):
                previous = None
                continue
            point = (x_of(index), frame.y_of(value))
            if previous:
                canvas.line(previous[0], previous[1], point[0], point[1], color, 2)
            canvas.rect(point[0] - 3, point[1] - 3, point[0] + 3, point[1] + 3, color)
            previous = point
    return canvas.png()
