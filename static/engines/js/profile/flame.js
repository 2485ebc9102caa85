// A flame graph of folded stacks ("a;b;c" -> samples), drawn on one canvas: the root at the
// bottom, each frame as wide as its share of the samples. Hover names a frame, its samples and
// share; click zooms into it (its callers stay as the full-width base); click the root to zoom out.

const ROW = 18;
const FONT = '11px "Segoe UI", system-ui, Roboto, sans-serif';

/** Folded stacks as a tree: {name, value, children: Map}. */
export function buildTree(folded) {
  const root = { name: "all", value: 0, children: new Map() };
  for (const [stack, samples] of folded) {
    let node = root;
    node.value += samples;
    for (const frame of stack.split(";")) {
      let child = node.children.get(frame);
      if (!child) {
        child = { name: frame, value: 0, children: new Map(), parent: node };
        node.children.set(frame, child);
      }
      child.value += samples;
      node = child;
    }
  }
  return root;
}

function depthOf(node) {
  let depth = 0;
  for (const child of node.children.values()) depth = Math.max(depth, depthOf(child));
  return depth + 1;
}

// Warm colours from the frame's name, stable between draws.
function colourOf(name) {
  let hash = 0;
  for (let i = 0; i < name.length; i++) hash = (hash * 31 + name.charCodeAt(i)) | 0;
  const hue = 10 + (Math.abs(hash) % 45);
  return `hsl(${hue}, 75%, ${58 + (Math.abs(hash >> 8) % 12)}%)`;
}

export class FlameGraph {
  constructor(box, tip, stacks) {
    this.box = box;
    this.tip = tip;
    this.root = buildTree(stacks.folded);
    this.total = this.root.value;
    this.focus = this.root;
    this.canvas = document.createElement("canvas");
    this.canvas.className = "flame-canvas";
    box.replaceChildren(this.canvas);
    this.boxes = [];
    this.canvas.addEventListener("mousemove", (event) => this.hover(event));
    this.canvas.addEventListener("mouseleave", () => { this.tip.hidden = true; });
    this.canvas.addEventListener("click", (event) => {
      const hit = this.at(event);
      if (hit) this.zoom(hit.node === this.focus ? this.root : hit.node);
    });
    this.draw();
  }

  zoom(node) {
    this.focus = node;
    this.draw();
  }

  draw() {
    this.canvas.style.width = "0"; // measured without the last draw's width, which held the box open
    const padding = parseFloat(getComputedStyle(this.box).paddingLeft) + parseFloat(getComputedStyle(this.box).paddingRight);
    const width = Math.max(320, this.box.clientWidth - padding);
    // The focused frame's ancestors each take a full-width row below it.
    const ancestors = [];
    for (let n = this.focus.parent; n; n = n.parent) ancestors.unshift(n);
    const rows = ancestors.length + depthOf(this.focus);
    const height = rows * ROW + 2;
    const ratio = window.devicePixelRatio || 1;
    this.canvas.width = width * ratio;
    this.canvas.height = height * ratio;
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    this.boxes = [];
    const put = (node, x, w, depth, dimmed) => {
      const y = height - (depth + 1) * ROW;
      ctx.fillStyle = dimmed ? "#ddd" : colourOf(node.name);
      ctx.fillRect(x, y, Math.max(w - 1, 0.5), ROW - 1);
      this.boxes.push({ node, x, y, w, h: ROW - 1 });
      if (w > 30) {
        ctx.fillStyle = "#222";
        ctx.save();
        ctx.beginPath();
        ctx.rect(x, y, w - 2, ROW);
        ctx.clip();
        ctx.fillText(node.name, x + 3, y + ROW / 2);
        ctx.restore();
      }
    };
    ancestors.forEach((node, depth) => put(node, 0, width, depth, true));
    const scale = width / this.focus.value;
    const walk = (node, x, depth) => {
      put(node, x, node.value * scale, depth, false);
      let childX = x;
      for (const child of [...node.children.values()].sort((a, b) => (a.name < b.name ? -1 : 1))) {
        if (child.value * scale >= 0.5) walk(child, childX, depth + 1);
        childX += child.value * scale;
      }
    };
    walk(this.focus, 0, ancestors.length);
  }

  at(event) {
    const rect = this.canvas.getBoundingClientRect();
    const x = event.clientX - rect.left, y = event.clientY - rect.top;
    return this.boxes.find((b) => x >= b.x && x < b.x + b.w && y >= b.y && y < b.y + b.h) || null;
  }

  hover(event) {
    const hit = this.at(event);
    if (!hit) {
      this.tip.hidden = true;
      return;
    }
    const share = (100 * hit.node.value) / this.total;
    this.tip.replaceChildren();
    const name = document.createElement("strong");
    name.textContent = hit.node.name;
    const detail = document.createElement("div");
    detail.textContent = `${hit.node.value} samples, ${share.toFixed(1)} % of all`;
    this.tip.append(name, detail);
    this.tip.hidden = false;
    this.tip.style.left = `${Math.min(event.clientX + 12, window.innerWidth - this.tip.offsetWidth - 8)}px`;
    this.tip.style.top = `${event.clientY + 12}px`;
  }
}
