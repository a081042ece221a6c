// UNet Compiler: "is it even working?" answered on the canvas.
//
// Listens to the pack's websocket events (sent by nodes/feedback.py) and
//  - draws a badge on Compile UNet / Warmup Shapes nodes: backend in use and
//    state (eager / planned / compiling / compiled / fallback);
//  - keeps the live warmup text ("shape 3/8, 1x768x768, 12.4 s"), which
//    ComfyUI itself shows under the node from send_progress_text;
//  - toasts a fallback to eager (or to another backend) with the reason and the fix;
//  - toasts a compile after warmup with the shape and the guard that caused it.
// Plain ES module, no build step. Loaded from WEB_DIRECTORY by ComfyUI.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EXTENSION = "UNetCompiler.Feedback";
const NODE_TYPES = new Set(["UNetCompiler_CompileUNet", "UNetCompiler_WarmupShapes"]);
const COLORS = {
  compiled: "#2e7d32",
  planned: "#1565c0",
  compiling: "#b26a00",
  fallback: "#c62828",
  eager: "#546e7a",
  interrupted: "#546e7a",
};
const TOAST_LIFE_MS = 20000;

// Same interface as the frontend's LGraphBadge (which it does not export to
// extensions): node.drawBadges() calls getWidth(ctx) and draw(ctx, x, y).
class StateBadge {
  constructor(node) {
    this.node = node;
    this.fgColor = "#ffffff";
    this.fontSize = 12;
    this.padding = 6;
    this.height = 20;
    this.cornerRadius = 5;
    this.xOffset = 0;
    this.yOffset = 0;
  }
  get text() {
    const s = this.node.unetCompiler;
    if (!s?.state) return "";
    // "eager" is both a backend and a state: say it once; after a warmup, the regions that ran compiled code
    const ran = s.regions && s.state !== "eager" ? ` ${s.ran}/${s.regions}` : "";
    return (s.backend === s.state || !s.backend ? s.state : `${s.backend} · ${s.state}`) + ran;
  }
  get bgColor() {
    return COLORS[this.node.unetCompiler?.state] ?? COLORS.eager;
  }
  get visible() {
    return this.text.length > 0;
  }
  getWidth(ctx) {
    if (!this.visible) return 0;
    const font = ctx.font;
    ctx.font = `${this.fontSize}px sans-serif`;
    const w = ctx.measureText(this.text).width;
    ctx.font = font;
    return w + this.padding * 2;
  }
  draw(ctx, x, y) {
    if (!this.visible) return;
    const { font, fillStyle, textBaseline, textAlign } = ctx;
    const w = this.getWidth(ctx);
    ctx.font = `${this.fontSize}px sans-serif`;
    ctx.fillStyle = this.bgColor;
    ctx.beginPath();
    if (ctx.roundRect) ctx.roundRect(x, y, w, this.height, this.cornerRadius);
    else ctx.rect(x, y, w, this.height);
    ctx.fill();
    ctx.fillStyle = this.fgColor;
    ctx.textBaseline = "middle";
    ctx.textAlign = "left";
    ctx.fillText(this.text, x + this.padding, y + this.height / 2 + 1);
    Object.assign(ctx, { font, fillStyle, textBaseline, textAlign });
  }
}

function attachBadge(node) {
  if (node.unetCompilerBadge) return;
  const badge = new StateBadge(node);
  node.unetCompilerBadge = badge;
  if (Array.isArray(node.badges)) {
    node.badges.push(() => badge);
  } else {
    // frontends without node badges: draw it in the title bar ourselves
    const onDrawForeground = node.onDrawForeground;
    node.onDrawForeground = function (ctx) {
      const r = onDrawForeground?.apply(this, arguments);
      if (!this.flags?.collapsed && badge.visible) {
        const title = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
        badge.draw(ctx, this.size[0] - badge.getWidth(ctx) - 4, -title + (title - badge.height) / 2);
      }
      return r;
    };
  }
}

// Execution ids look like "12" or, inside subgraphs, "5:3:12".
function nodeFor(executionId) {
  if (executionId == null) return null;
  let graph = app.graph;
  let node = null;
  for (const part of String(executionId).split(":")) {
    node = graph?.getNodeById?.(part) ?? null;
    if (!node) return null;
    graph = node.subgraph ?? graph;
  }
  return node;
}

function update(node, patch) {
  if (!node) return;
  attachBadge(node);
  node.unetCompiler = { ...(node.unetCompiler ?? {}), ...patch, updated: Date.now() };
  node.setDirtyCanvas?.(true, true);
  app.graph?.setDirtyCanvas?.(true, true);
}

function toast(severity, summary, detail) {
  const t = app.extensionManager?.toast;
  if (t?.add) t.add({ severity, summary, detail, life: TOAST_LIFE_MS });
  else console.warn(`${summary}: ${detail}`);
}

function nodeLabel(node, id) {
  return node?.title ? `${node.title} (#${id})` : `node #${id}`;
}

function onCompile({ detail }) {
  const node = nodeFor(detail.node_id);
  update(node, {
    backend: detail.backend,
    state: detail.state,
    requested: detail.requested,
    reason: detail.reason,
    fix: detail.fix,
    text: detail.text,
  });
  if (detail.state === "fallback") {
    const to = detail.backend === "eager" ? "eager" : detail.backend;
    toast(
      "warn",
      `UNet Compiler: ${nodeLabel(node, detail.node_id)} fell back to ${to}`,
      `${detail.reason}. Fix: ${detail.fix}.`,
    );
  }
}

function onWarmup({ detail }) {
  const node = nodeFor(detail.node_id);
  update(node, {
    backend: detail.backend,
    state: detail.state,
    progress: detail.text,
    phase: detail.phase,
    // "ran of regions" comes with a warmup's end; any other event clears the count it showed
    ran: detail.ran,
    regions: detail.regions,
  });
  // no toast here: a failing region already sent unet_compiler.fallback, a
  // backend that could not load already toasted at Compile UNet
}

const toasted = new Set();

function onFallback({ detail }) {
  const nodes = (detail.node_ids ?? []).map((id) => [id, nodeFor(id)]);
  for (const [, node] of nodes) {
    // a kind fell back after the warmup's count: that count no longer holds
    update(node, { backend: detail.backend, state: "fallback", reason: detail.reason, fix: detail.fix,
                   ran: undefined, regions: undefined });
  }
  // one toast per failing region kind and node set, not one per step
  const key = `${detail.kind}|${detail.node_ids?.join(",")}|${detail.reason}`;
  if (toasted.has(key)) return;
  toasted.add(key);
  const where = nodes.length ? nodeLabel(nodes[0][1], nodes[0][0]) : "a compiled model";
  toast("warn", `UNet Compiler: ${detail.kind} regions of ${where} fell back to eager`,
    `${detail.reason}. Fix: ${detail.fix}.`);
}

// Code compiled after warmup: one toast per prompt and shape, naming the shape and the guard.
function onRecompile({ detail }) {
  const key = `${detail.prompt}|${detail.shape}|${detail.node_ids?.join(",")}`;
  if (toasted.has(key)) return;
  toasted.add(key);
  toast("info", `UNet Compiler: compiled again for ${detail.shape ?? "a new shape"}`, detail.text);
}

// A cancelled or failed prompt leaves no node "compiling" forever.
function onStopped() {
  for (const node of app.graph?._nodes ?? []) {
    if (node.unetCompiler?.state === "compiling") update(node, { state: "interrupted" });
  }
}

app.registerExtension({
  name: EXTENSION,
  async setup() {
    api.addEventListener("unet_compiler.compile", onCompile);
    api.addEventListener("unet_compiler.warmup", onWarmup);
    api.addEventListener("unet_compiler.fallback", onFallback);
    api.addEventListener("unet_compiler.recompile", onRecompile);
    api.addEventListener("execution_interrupted", onStopped);
    api.addEventListener("execution_error", onStopped);
  },
  async nodeCreated(node) {
    if (NODE_TYPES.has(node.comfyClass)) attachBadge(node);
  },
});
