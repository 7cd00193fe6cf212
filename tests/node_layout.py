"""How large ComfyUI's frontends draw a node, from its title, sockets, outputs and widgets: LiteGraph's
LGraphNode.computeSize, plus the widths below which the frontends cut a title or a widget's label or value short.
The rules are the frontends' own (ComfyUI_frontend 1.27.10 and 1.49.6, src/lib/litegraph/src/LGraphNode.ts,
widgets/*.ts, LiteGraphGlobal.ts; src/scripts/domWidget.ts, src/renderer/extensions/vueNodes/widgets/composables);
text widths come from tests/frontend_fonts.py. On load the frontends draw a node at the larger of its saved size and
computeSize (src/scripts/app.ts, loadGraphData), so a saved size at least min_size() is drawn as saved."""
import math
from dataclasses import dataclass

import frontend_fonts
from workflow_nodes import drawn_outputs, titles, widgets

# LiteGraphGlobal.ts (the same in both frontends)
TITLE_HEIGHT = 30          # NODE_TITLE_HEIGHT: the title bar, drawn above the node's pos
SLOT_HEIGHT = 20           # NODE_SLOT_HEIGHT
WIDGET_HEIGHT = 20         # NODE_WIDGET_HEIGHT
NODE_WIDTH = 140           # NODE_WIDTH; computeSize's minimum is 1.5 times it for a node with widgets
TITLE_TEXT_SIZE = 14       # NODE_TEXT_SIZE: the title's font size
TEXT_SIZE = 12             # NODE_SUBTEXT_SIZE: slots and widgets
# widgets/BaseWidget.ts
MARGIN = 15                # the widget's inset from the node's sides
ARROW_MARGIN = 6
ARROW_WIDTH = 10
MIN_VALUE_WIDTH = 42
LABEL_VALUE_GAP = 5
# scripts/domWidget.ts: a DOM widget (multiline text, Markdown) with no min-height of its own asks for 50
DOM_WIDGET_MIN_HEIGHT = 50
# useImagePreviewWidget.ts: the image a Load Image / Save Image node shows asks for 220
IMAGE_PREVIEW_MIN_HEIGHT = 220

FRONTEND_FONTS = {"1.27.10": "Arial", "1.49.6": "Inter"}   # LiteGraph.NODE_FONT
UPLOAD_LABEL = "choose file to upload"    # the en locale's g.choose_file_to_upload: Load Image's upload button


TEXT_SLACK = 1.0   # px: the most a drawn string exceeds the sum of its characters is 0.52 (tests/frontend_fonts.py)


def text_width(text: str, font: str, size: int) -> float:
    """At least the width the canvas draws `text` at (a character outside the table counts as the widest)."""
    table = frontend_fonts.WIDTHS[(font, size)]
    widest = max(table)
    return sum(table[ord(c) - 32] if 32 <= ord(c) < 127 else widest for c in text) + (TEXT_SLACK if text else 0)


@dataclass(frozen=True)
class Widget:
    kind: str          # number, combo, text, toggle, button, multiline, markdown, preview
    label: str
    shown: str         # the value as the widget draws it


def _number_text(value, spec) -> str:
    """NumberWidget._displayValue: toFixed(precision); INT precision 0, FLOAT precision from the step
    (useFloatWidget: max(0, -floor(log10(step))), step 0.5 when none is given)."""
    if spec["type"] == "INT":
        return str(int(value))
    step = spec.get("step") or 0.5
    return f"{float(value):.{max(0, -math.floor(math.log10(step)))}f}"


def drawn_widgets(definition, values) -> list[Widget]:
    """The widgets a node draws, with the values saved in widgets_values (in the same order)."""
    drawn, i = [], 0
    for spec in widgets(definition):
        value = values[i] if i < len(values) else spec.get("default")
        i += 1
        kind = spec["widget"]
        if kind == "number":
            drawn.append(Widget("number", spec["name"], _number_text(value, spec)))
        elif kind == "toggle":
            drawn.append(Widget("toggle", spec["name"], "true" if value else "false"))
        elif kind in ("multiline", "markdown"):
            drawn.append(Widget(kind, spec["name"], ""))
        else:
            drawn.append(Widget(kind, spec["name"], str(value)))
        extra = spec.get("ui_extra")
        if extra:
            shown = values[i] if i < len(values) else "fixed"
            i += 1
            if extra["name"] == "control_after_generate":   # scripts/widgets.ts: a combo labelled from the locale
                drawn.append(Widget("combo", "control after generate", str(shown)))
            else:                                            # useImageUploadWidget: a button
                drawn.append(Widget("button", UPLOAD_LABEL, ""))
    if definition.get("image_preview"):
        drawn.append(Widget("preview", "", ""))
    return drawn


def _widget_height(w: Widget) -> int:
    if w.kind == "preview":
        return IMAGE_PREVIEW_MIN_HEIGHT
    return DOM_WIDGET_MIN_HEIGHT if w.kind in ("multiline", "markdown") else WIDGET_HEIGHT


def _titles(node_type, definition, title):
    return {title} if title else titles(node_type, definition)


def compute_size(node_type, definition, values, font, title=None) -> tuple[float, float]:
    """LGraphNode.computeSize: the body (below the title bar) of a node with these widgets, drawn with `font`.
    Widget inputs have sockets too, but only the others count as rows."""
    sockets = [i["name"] for i in definition["inputs"] if "widget" not in i]
    outputs = [n for _, n in drawn_outputs(node_type, definition)]
    drawn = drawn_widgets(definition, values)
    rows = max(len(sockets), len(outputs), 1)
    title_width = TITLE_HEIGHT + TITLE_HEIGHT * 0.33 + max(text_width(t, font, TITLE_TEXT_SIZE)
                                                           for t in _titles(node_type, definition, title))
    inputs_width = max((text_width(s, font, TEXT_SIZE) for s in sockets), default=0)
    outputs_width = max((text_width(o, font, TEXT_SIZE) for o in outputs), default=0)
    slots_width = inputs_width + outputs_width + 2 * SLOT_HEIGHT + (5 if inputs_width and outputs_width else 0)
    # the widget sockets' labels are the widgets' names (the UI-only widgets have no socket, nor have the frontend's
    # own nodes' widgets); Load Image's upload button has one, labelled as the button
    labels = [] if definition.get("virtual") else [
        text_width(n, font, TEXT_SIZE) for w in widgets(definition)
        for n in ((w["name"], UPLOAD_LABEL) if w.get("image_upload") else (w["name"],))]
    widget_width = max(labels, default=0)
    if widget_width:
        widget_width += MIN_VALUE_WIDTH + 2 * (MARGIN + ARROW_MARGIN + ARROW_WIDTH)
    width = max(slots_width, widget_width, title_width, NODE_WIDTH * (1.5 if drawn else 1))
    height = rows * SLOT_HEIGHT
    if drawn:
        height += sum(_widget_height(w) + 4 for w in drawn) + 8
    return width, height + 6


def uncut_width(node_type, definition, values, font, title=None) -> float:
    """The narrowest width at which the frontend draws the title and every widget's label and value whole."""
    # drawTitleText: the title gets the width less twice the title height, else it is truncated with an ellipsis
    title_text = max(text_width(t, font, TITLE_TEXT_SIZE) for t in _titles(node_type, definition, title))
    need = [title_text + 2 * TITLE_HEIGHT]
    for w in drawn_widgets(definition, values):
        label, shown = text_width(w.label, font, TEXT_SIZE), text_width(w.shown, font, TEXT_SIZE)
        if w.kind in ("number", "combo"):
            # BaseSteppedWidget: drawTruncatingText with leftPadding 5, rightPadding 20 inside 2 margins a side
            need.append(label + LABEL_VALUE_GAP + shown + 4 * MARGIN + 5 + 20)
        elif w.kind == "text":
            need.append(label + LABEL_VALUE_GAP + shown + 4 * MARGIN)                # TextWidget: no padding
        elif w.kind == "toggle":
            # BooleanWidget: label from 2 margins, value right-aligned 40 from the edge; never truncated, so they
            # must not meet
            need.append(2 * MARGIN + label + LABEL_VALUE_GAP + shown + 40)
        elif w.kind == "button":
            need.append(label + 4 * MARGIN)                                          # ButtonWidget: centred
    return max(need)


# Nodes 2.0, the Vue node display (a setting in frontend 1.49.6): each node is a DOM box of a header, the socket rows,
# a grid of widget rows and, under the pack's nodes (its source) and experimental ones, a badge row; it is at least
# its saved size. Measured from the page's DOM (element heights in graph units, 1.49.6 with ComfyUI 0.33.0): the
# rule below gives the drawn size of every node in the workflows, except Save Video's, which 0.33.0's frontend redraws
# at its content's height (its format widget is a DynamicCombo) and so smaller than saved.
VUE_HEADER = 28
VUE_PADDING = 4            # above the socket rows, and between the blocks
VUE_SLOT_ROW = 20
VUE_WIDGET = 24            # a combo, number or toggle; a seed's control_after_generate is drawn inside its widget
VUE_TEXT_WIDGET = 32       # a single-line text
VUE_TEXT_BOX = 64          # the least height of a multi-line text box (a prompt, a Markdown note)
VUE_WIDGET_GAP = 4
VUE_BADGE = 20
VUE_ADVANCED_BUTTON = 24   # "Show advanced inputs", in place of the advanced widgets, which it hides
VUE_BOTTOM = 12
VUE_MIN_WIDTH = 225


def vue_size(node_type, definition, saved) -> tuple[int, int]:
    """The (width, height), title bar included, Nodes 2.0 draws a node saved at `saved` (its body) at."""
    sockets = [i for i in definition["inputs"] if "widget" not in i]
    rows = max(len(sockets), len(drawn_outputs(node_type, definition)))
    shown = [w for w in widgets(definition) if not w.get("advanced")]
    height = VUE_HEADER + VUE_PADDING + rows * VUE_SLOT_ROW
    if shown:
        tall = {"text": VUE_TEXT_WIDGET, "multiline": VUE_TEXT_BOX, "markdown": VUE_TEXT_BOX}
        height += VUE_PADDING + sum(tall.get(w["widget"], VUE_WIDGET) for w in shown)
        height += VUE_WIDGET_GAP * (len(shown) - 1)
    if definition.get("ours") or definition.get("experimental"):
        height += VUE_PADDING + VUE_BADGE
    height += VUE_BOTTOM
    if len(shown) < len(widgets(definition)):
        height += VUE_ADVANCED_BUTTON
    return max(saved[0], VUE_MIN_WIDTH), max(saved[1] + TITLE_HEIGHT, height)


def min_size(node_type, definition, values, title=None) -> tuple[int, int]:
    """The smallest (width, height) at which both frontends draw the node as computed and uncut, in whole pixels:
    the larger of the two, with the inputs and outputs of the newest ComfyUI checked (a superset of older ones)."""
    width = height = 0.0
    for font in FRONTEND_FONTS.values():
        w, h = compute_size(node_type, definition, values, font, title)
        width = max(width, w, uncut_width(node_type, definition, values, font, title))
        height = max(height, h)
    return math.ceil(width), math.ceil(height)
