// xDiT Engine Info: draws the report the node returns (its ui "text") in the node itself after every run, as a
// read-only text box under the unload toggle.
// The report is kept in the node's properties, not in widgets_values: a saved workflow's Info node keeps
// widgets_values = [unload] (what every release saved), so no saved value can land in the wrong widget, and the
// box is left out of the queued prompt. Reloading a saved workflow draws its last report again.
import { app } from "../../scripts/app.js";

const NODE_TYPE = "XDiTEngineInfo";
const WIDGET = "report";
const PROPERTY = "xdit_report";
const WIDTH = 420;          // the Info node's width in the example workflows: a report line wraps about twice there
const LINE_PX = 15, CHARS_PER_LINE = 56, MAX_LINES = 18;

function reportWidget(node) {
  const found = node.widgets?.find((w) => w.name === WIDGET);
  if (found) return found;
  // ComfyWidgets is reached through window.comfyAPI: importing scripts/widgets.js warns in newer frontends
  const { ComfyWidgets } = window.comfyAPI.widgets;
  const widget = ComfyWidgets.STRING(node, WIDGET, ["STRING", { multiline: true }], app).widget;
  widget.serialize = false;          // not in widgets_values
  widget.options.serialize = false;  // not an input of the queued prompt
  widget.options.read_only = true;   // the Vue node display's text box reads this
  // The box's height follows the report (wrapped lines, up to MAX_LINES; more scroll)
  widget.options.getMinHeight = () => {
    const text = String(widget.value ?? "");
    const lines = text.split("\n").reduce((n, line) => n + Math.max(1, Math.ceil(line.length / CHARS_PER_LINE)), 0);
    return Math.min(lines, MAX_LINES) * LINE_PX + 12;
  };
  const box = widget.element ?? widget.inputEl;   // the classic display's <textarea>
  if (box) {
    box.readOnly = true;
    box.style.opacity = "0.85";
  }
  return widget;
}

function showReport(node, text, grow) {
  reportWidget(node).value = text;
  node.properties ??= {};
  node.properties[PROPERTY] = text;
  if (!grow) return;
  // Grown to fit the box (and to WIDTH), never shrunk: a larger size the user gave the node stays
  requestAnimationFrame(() => {
    const [width, height] = node.computeSize();
    node.setSize([Math.max(width, WIDTH, node.size[0]), Math.max(height, node.size[1])]);
    node.setDirtyCanvas?.(true, true);
  });
}

function reportText(output) {
  const text = output?.text;
  if (text == null) return null;
  return Array.isArray(text) ? text.join("\n") : String(text);
}

app.registerExtension({
  name: "xDiT.EngineInfo",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== NODE_TYPE) return;

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      const text = reportText(output);
      if (text != null) showReport(this, text, true);
    };

    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (info) {
      onConfigure?.apply(this, arguments);
      const text = info?.properties?.[PROPERTY];
      if (typeof text === "string" && text) showReport(this, text, false);
    };
  },
});
