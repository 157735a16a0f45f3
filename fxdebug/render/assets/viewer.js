/* fxdebug interactive graph viewer.
 *
 * Reads the graph from <script id="fxdebug-data" type="application/json"> and draws it with
 * dagre's layout. Module clusters start collapsed (one box each) below the levels that fit; a click
 * on a box expands it, a click on an open cluster's title collapses it. Only what is visible is laid
 * out: a collapsed cluster is one box however many nodes it holds, so opening a 10,000-node graph
 * lays out a few dozen boxes, and expanding a cluster lays out that cluster's children in place.
 *
 * window.fxdebugViewer exposes the same actions the page's controls use (expand, collapse, reveal,
 * search, colourBy), for scripts and tests.
 */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("fxdebug-data").textContent);
  var SVGNS = "http://www.w3.org/2000/svg";
  var AUTO_OPEN = 60; // expand clusters breadth-first while fewer boxes than this are visible
  var LINE = 14, CHAR = 6.6, PAD = 8;

  // -- the cluster tree --------------------------------------------------------------------------
  var nodes = DATA.nodes;
  var byName = {};
  nodes.forEach(function (n, i) { n.index = i; byName[n.name] = n; });
  var clusters = {"": {path: "", parent: null, children: [], nodes: [], count: 0, depth: 0}};
  function cluster(path) {
    if (clusters[path]) return clusters[path];
    var cut = path.lastIndexOf(".");
    var parentPath = cut < 0 ? "" : path.slice(0, cut);
    var parent = cluster(parentPath);
    var c = {path: path, parent: parent, children: [], nodes: [], count: 0, depth: parent.depth + 1};
    clusters[path] = c;
    parent.children.push(c);
    return c;
  }
  nodes.forEach(function (n) {
    if (n.hidden) return;
    var c = cluster(n.cluster);
    c.nodes.push(n);
    for (var p = c; p; p = p.parent) p.count += 1;
  });
  var shownNodes = nodes.filter(function (n) { return !n.hidden; });
  function isFinding(n) { return n.origin || n.grad_origin || n.failed; }
  nodes.forEach(function (n) {
    if (n.hidden || !(isFinding(n) || n.nonfinite)) return;
    for (var c = clusters[n.cluster]; c; c = c.parent) {
      c.nonfinite = c.nonfinite || n.nonfinite;
      if (isFinding(n)) c.finding = c.finding || n;
      if (n.origin || n.grad_origin) c.origin = true;
      if (n.failed) c.failed = true;
    }
  });
  nodes.forEach(function (n) {
    if (n.hidden || !n.dead) return;
    for (var c = clusters[n.cluster]; c; c = c.parent) c.dead = true;
  });

  var expanded = {"": true};
  (function autoOpen() {
    var visible = clusters[""].children.length + clusters[""].nodes.length;
    var queue = clusters[""].children.slice();
    while (queue.length) {
      var c = queue.shift();
      if (c.path.slice(c.path.lastIndexOf(".") + 1).indexOf("(mask") === 0) continue; // plumbing stays closed
      var grow = c.children.length + c.nodes.length - 1;
      if (visible + grow > AUTO_OPEN) continue;
      expanded[c.path] = true;
      visible += grow;
      queue = queue.concat(c.children);
    }
  })();

  // -- what is visible ---------------------------------------------------------------------------
  function itemOf(n) {
    // the outermost collapsed cluster holding n, or n itself
    var chain = [];
    for (var c = clusters[n.cluster]; c && c.path !== ""; c = c.parent) chain.push(c);
    for (var i = chain.length - 1; i >= 0; i--) if (!expanded[chain[i].path]) return "c:" + chain[i].path;
    return "n:" + n.name;
  }

  // -- colour -------------------------------------------------------------------------------------
  var colourKey = "";
  var range = null;
  function numeric(v) { return typeof v === "number" && isFinite(v); }
  function valueOf(n, key) {
    if (key.indexOf("diff:") === 0) return DATA.diff ? DATA.diff[n.name] : undefined;
    return n.stats ? n.stats[key] : undefined;
  }
  function computeRange(key) {
    if (key.indexOf("diff:") === 0) return {lo: 0, hi: 1};  // scores: divergence / (10 rtol), capped at 1
    var vals = [];
    shownNodes.forEach(function (n) { var v = valueOf(n, key); if (numeric(v)) vals.push(v); });
    if (!vals.length) return null;
    vals.sort(function (a, b) { return a - b; });
    return {lo: vals[0], hi: vals[vals.length - 1], sorted: vals};
  }
  function heat(v) {
    if (!range || !numeric(v)) return null;
    var t = range.hi > range.lo ? (v - range.lo) / (range.hi - range.lo) : 1;
    var r = 255, g = Math.round(245 - 170 * t), b = Math.round(235 - 215 * t);
    return "rgb(" + r + "," + g + "," + b + ")";
  }
  function clusterValue(c, key) {
    var best;
    (function walk(k) {
      k.nodes.forEach(function (n) { var v = valueOf(n, key); if (numeric(v) && (best === undefined || v > best)) best = v; });
      k.children.forEach(walk);
    })(c);
    return best;
  }
  function findingClass(x) {
    if (x.origin || x.grad_origin) return "origin";
    if (x.failed) return "failed";
    if (x.nonfinite) return "nonfinite";
    if (x.dead) return "dead";
    return "";
  }

  // -- layout and drawing --------------------------------------------------------------------------
  var svg = document.getElementById("canvas");
  var root = document.createElementNS(SVGNS, "g");
  svg.appendChild(root);
  var view = {x: 0, y: 0, k: 1};
  var selected = null;
  var lastLayoutMs = 0;

  function el(tag, attrs, parent) {
    var e = document.createElementNS(SVGNS, tag);
    for (var a in attrs) e.setAttribute(a, attrs[a]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (typeof v !== "number") return String(v);
    if (!isFinite(v)) return String(v);
    if (v === Math.round(v) && Math.abs(v) < 1e6) return String(v);
    var a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e4) ? v.toExponential(2) : v.toPrecision(4).replace(/\.?0+$/, "");
  }
  function shapeText(s) { return s ? "(" + s.join(", ") + ")" : ""; }
  function nodeLines(n) {
    var head = n.kind === "placeholder" ? "input " + n.name : n.kind === "output" ? "output" : n.name + " : " + n.op;
    var lines = [head];
    if (n.shape) lines.push(shapeText(n.shape) + (n.dtype ? " " + n.dtype : ""));
    if (colourKey && numeric(valueOf(n, colourKey))) lines.push(colourKey + " " + fmt(valueOf(n, colourKey)));
    if (n.origin) lines.push("NaN/Inf ORIGIN");
    else if (n.grad_origin) lines.push("NaN/Inf gradient ORIGIN");
    else if (n.failed) lines.push("FAILED check");
    return lines;
  }
  function clusterLines(c) {
    var typ = DATA.modules[c.path];
    var lines = [c.path + (typ ? " : " + typ : ""), c.count + " nodes  [+]"];
    if (c.finding) lines.push((c.finding.failed && !c.finding.origin ? "FAILED: " : "ORIGIN inside: ") + c.finding.name);
    else if (c.nonfinite) lines.push("NaN/Inf inside");
    if (colourKey && numeric(clusterValue(c, colourKey))) lines.push("max " + colourKey + " " + fmt(clusterValue(c, colourKey)));
    return lines;
  }
  function boxSize(lines) {
    var w = 0;
    lines.forEach(function (l) { w = Math.max(w, l.length); });
    return {width: Math.min(420, w * CHAR + 2 * PAD), height: lines.length * LINE + PAD};
  }

  function layout() {
    var t0 = performance.now();
    var g = new dagre.graphlib.Graph({compound: true, multigraph: false});
    g.setGraph({rankdir: "TB", nodesep: 18, ranksep: 28, marginx: 20, marginy: 20});
    g.setDefaultEdgeLabel(function () { return {}; });
    var items = {};
    function addCluster(c) {
      c.children.forEach(function (k) {
        if (expanded[k.path]) {
          g.setNode("g:" + k.path, {kind: "open", cluster: k, paddingTop: 24});
          if (c.path !== "") g.setParent("g:" + k.path, "g:" + c.path);
          addCluster(k);
        } else {
          var lines = clusterLines(k);
          var s = boxSize(lines);
          g.setNode("c:" + k.path, {kind: "box", cluster: k, lines: lines, width: s.width, height: s.height});
          items["c:" + k.path] = true;
          if (c.path !== "") g.setParent("c:" + k.path, "g:" + c.path);
        }
      });
      c.nodes.forEach(function (n) {
        var lines = nodeLines(n);
        var s = boxSize(lines);
        g.setNode("n:" + n.name, {kind: "node", node: n, lines: lines, width: s.width, height: s.height});
        items["n:" + n.name] = true;
        if (c.path !== "") g.setParent("n:" + n.name, "g:" + c.path);
      });
    }
    addCluster(clusters[""]);
    var rep = {};
    shownNodes.forEach(function (n) { rep[n.name] = itemOf(n); });
    shownNodes.forEach(function (n) {
      var dst = rep[n.name];
      n.inputs.forEach(function (i) {
        var src = rep[nodes[i].name];
        if (src && dst && src !== dst && items[src] && items[dst] && !g.hasEdge(src, dst)) g.setEdge(src, dst, {});
      });
    });
    // A compound node with no children makes dagre fail: give empty open clusters a placeholder.
    g.nodes().forEach(function (id) {
      if (id.indexOf("g:") === 0 && !(g.children(id) || []).length) {
        g.setNode(id + "/empty", {kind: "empty", width: 40, height: 10});
        g.setParent(id + "/empty", id);
      }
    });
    dagre.layout(g);
    lastLayoutMs = performance.now() - t0;
    return g;
  }

  function draw() {
    var g = layout();
    while (root.firstChild) root.removeChild(root.firstChild);
    var layerClusters = el("g", {"class": "clusters"}, root);
    var layerEdges = el("g", {"class": "edges"}, root);
    var layerNodes = el("g", {"class": "nodes"}, root);
    var count = 0, boxes = 0;
    g.nodes().forEach(function (id) {
      var d = g.node(id);
      if (!d || d.kind !== "open") return;
      var c = d.cluster;
      var grp = el("g", {"class": "cluster open " + findingClass(c), "data-cluster": c.path}, layerClusters);
      el("rect", {x: d.x - d.width / 2, y: d.y - d.height / 2, width: d.width, height: d.height, rx: 6}, grp);
      var typ = DATA.modules[c.path];
      var title = el("text", {x: d.x - d.width / 2 + 8, y: d.y - d.height / 2 + 15, "class": "ctitle"}, grp);
      title.textContent = "[−] " + c.path + (typ ? " : " + typ : "");
      title.addEventListener("click", function (ev) { ev.stopPropagation(); collapse(c.path); });
    });
    g.edges().forEach(function (e) {
      var pts = g.edge(e).points || [];
      if (!pts.length) return;
      var dstr = "M" + pts.map(function (p) { return p.x.toFixed(1) + "," + p.y.toFixed(1); }).join(" L");
      el("path", {d: dstr, "class": "edge", "marker-end": "url(#arrow)"}, layerEdges);
    });
    g.nodes().forEach(function (id) {
      var d = g.node(id);
      if (!d || (d.kind !== "node" && d.kind !== "box")) return;
      var x0 = d.x - d.width / 2, y0 = d.y - d.height / 2;
      var grp, fill = null;
      if (d.kind === "node") {
        var n = d.node;
        count += 1;
        grp = el("g", {"class": "node " + findingClass(n) + (n.kind === "placeholder" || n.kind === "output" ? " io" : "")
          + (selected === n.name ? " selected" : ""), "data-node": n.name}, layerNodes);
        if (colourKey) fill = heat(valueOf(n, colourKey));
        grp.addEventListener("click", function (ev) { ev.stopPropagation(); select(n.name); });
        el("title", {}, grp).textContent = n.name + " (" + (n.module || "<root>") + ")";
      } else {
        var c = d.cluster;
        boxes += 1;
        grp = el("g", {"class": "cluster box " + findingClass(c), "data-cluster": c.path}, layerNodes);
        if (colourKey) fill = heat(clusterValue(c, colourKey));
        grp.addEventListener("click", function (ev) { ev.stopPropagation(); expand(c.path); });
        el("title", {}, grp).textContent = "click to expand " + c.path;
      }
      var rect = el("rect", {x: x0, y: y0, width: d.width, height: d.height, rx: d.kind === "node" ? 4 : 2}, grp);
      if (fill && !grp.getAttribute("class").match(/origin|failed/)) rect.setAttribute("style", "fill:" + fill);
      d.lines.forEach(function (line, i) {
        var t = el("text", {x: x0 + PAD, y: y0 + PAD / 2 + LINE * (i + 1) - 3}, grp);
        t.textContent = line;
      });
    });
    var gg = g.graph();
    svg.setAttribute("data-width", Math.round(gg.width || 0));
    svg.setAttribute("data-height", Math.round(gg.height || 0));
    document.getElementById("visible").textContent = "drawn: " + count + " nodes, " + boxes + " closed modules ("
      + Math.round(lastLayoutMs) + " ms)";
    applyView();
    return g;
  }

  // -- pan and zoom --------------------------------------------------------------------------------
  function applyView() { root.setAttribute("transform", "translate(" + view.x + "," + view.y + ") scale(" + view.k + ")"); }
  var drag = null;
  svg.addEventListener("mousedown", function (ev) { drag = {x: ev.clientX - view.x, y: ev.clientY - view.y}; });
  window.addEventListener("mouseup", function () { drag = null; });
  window.addEventListener("mousemove", function (ev) {
    if (!drag) return;
    view.x = ev.clientX - drag.x; view.y = ev.clientY - drag.y; applyView();
  });
  svg.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    var f = ev.deltaY < 0 ? 1.15 : 1 / 1.15;
    var r = svg.getBoundingClientRect();
    var mx = ev.clientX - r.left, my = ev.clientY - r.top;
    view.x = mx - (mx - view.x) * f; view.y = my - (my - view.y) * f; view.k *= f; applyView();
  }, {passive: false});
  function fit(minScale) {
    // the whole picture on screen, or (minScale) no smaller than that, from the top
    var gw = +svg.getAttribute("data-width"), gh = +svg.getAttribute("data-height");
    var r = svg.getBoundingClientRect();
    if (!gw || !gh || !r.width || !r.height) return;
    var floor = typeof minScale === "number" ? minScale : 0.05;
    view.k = Math.max(floor, Math.min(1.5, Math.min(r.width / gw, r.height / gh)));
    view.x = (r.width - gw * view.k) / 2;
    view.y = Math.max(0, (r.height - gh * view.k) / 2);
    applyView();
  }
  document.getElementById("fit").addEventListener("click", function () { fit(); });
  function centre(selector) {
    var e = root.querySelector(selector);
    if (!e) return;
    var b = e.getBBox(), r = svg.getBoundingClientRect();
    view.x = r.width / 2 - (b.x + b.width / 2) * view.k;
    view.y = r.height / 2 - (b.y + b.height / 2) * view.k;
    applyView();
  }

  // -- actions ---------------------------------------------------------------------------------------
  function expand(path) {
    for (var c = clusters[path]; c; c = c.parent) expanded[c.path] = true;
    draw();
    centre('[data-cluster="' + cssEscape(path) + '"]');
  }
  function collapse(path) {
    Object.keys(expanded).forEach(function (p) { if (p === path || p.indexOf(path + ".") === 0) delete expanded[p]; });
    expanded[""] = true;
    draw();
    centre('[data-cluster="' + cssEscape(path) + '"]');
  }
  function reveal(name) {
    var n = byName[name];
    if (!n) return false;
    for (var c = clusters[n.cluster]; c; c = c.parent) expanded[c.path] = true;
    selected = name;
    draw();
    view.k = Math.max(view.k, 1);  // readable at the node
    centre('[data-node="' + cssEscape(name) + '"]');
    showNode(n);
    return true;
  }
  function select(name) {
    selected = name;
    var prev = root.querySelectorAll(".node.selected");
    for (var i = 0; i < prev.length; i++) prev[i].classList.remove("selected");
    var e = root.querySelector('[data-node="' + cssEscape(name) + '"]');
    if (e) e.classList.add("selected");
    showNode(byName[name]);
  }
  function cssEscape(s) { return String(s).replace(/["\\]/g, "\\$&"); }

  // -- side panel --------------------------------------------------------------------------------------
  var panel = document.getElementById("details");
  function row(table, key, value, cls) {
    var tr = document.createElement("tr");
    var th = document.createElement("th"); th.textContent = key;
    var td = document.createElement("td"); td.textContent = value;
    if (cls) td.className = cls;
    tr.appendChild(th); tr.appendChild(td); table.appendChild(tr);
  }
  function showNode(n) {
    panel.innerHTML = "";
    var h = document.createElement("h2"); h.textContent = n.name; panel.appendChild(h);
    var t = document.createElement("table"); t.id = "node-table"; panel.appendChild(t);
    row(t, "op", n.op + " (" + n.kind + ")");
    row(t, "module", (n.module || "<root>") + (n.module_type ? " (" + n.module_type + ")" : ""));
    if (n.shape) row(t, "shape", shapeText(n.shape) + " " + (n.dtype || "") + " " + (n.device || ""));
    if (n.origin) row(t, "finding", "NaN/Inf ORIGIN: first node that turned finite inputs into NaN/Inf", "bad");
    if (n.grad_origin) row(t, "finding", "NaN/Inf gradient ORIGIN", "bad");
    if (n.failed) row(t, "FAILED", n.failed, "bad");
    (n.params || []).forEach(function (p) { row(t, "reads", p[0] + " " + shapeText(p[1])); });
    (n.inputs || []).forEach(function (i) { var s = nodes[i]; row(t, "input", s.name + " " + shapeText(s.shape)); });
    DATA.columns.forEach(function (col) {
      if (n.stats && col.key in n.stats) row(t, col.label || col.key, fmt(n.stats[col.key]));
    });
    Object.keys(n.stats || {}).sort().forEach(function (k) {
      if (!DATA.columns.some(function (c) { return c.key === k; })) row(t, k, fmt(n.stats[k]));
    });
    if (DATA.diff_text && n.name in DATA.diff_text) row(t, "diff", DATA.diff_text[n.name], DATA.diff_first === n.name ? "bad" : "");
    if (n.probes && n.probes.length) row(t, "observed by", n.probes.join(", "));
    if (n.added_by) row(t, "added by pass", n.added_by);
    if (n.changed_by && n.changed_by.length) row(t, "changed by pass", n.changed_by.join(", "));
    (n.notes || []).forEach(function (x) { row(t, "note", x); });
    if (n.source) row(t, "source", n.source);
  }

  // -- search ----------------------------------------------------------------------------------------
  var results = document.getElementById("results");
  function search(q) {
    q = String(q || "").trim().toLowerCase();
    results.innerHTML = "";
    if (!q) return [];
    var hits = shownNodes.filter(function (n) {
      return n.name.toLowerCase().indexOf(q) >= 0 || (n.module || "").toLowerCase().indexOf(q) >= 0;
    });
    hits.slice(0, 100).forEach(function (n) {
      var li = document.createElement("li");
      li.textContent = n.name + "  " + (n.module || "<root>");
      li.setAttribute("data-hit", n.name);
      li.addEventListener("click", function () { reveal(n.name); });
      results.appendChild(li);
    });
    var more = document.createElement("li");
    more.className = "count";
    more.textContent = hits.length + " match" + (hits.length === 1 ? "" : "es");
    results.insertBefore(more, results.firstChild);
    if (hits.length === 1) reveal(hits[0].name);
    return hits.map(function (n) { return n.name; });
  }
  var box = document.getElementById("search");
  box.addEventListener("keydown", function (ev) { if (ev.key === "Enter") search(box.value); });

  // -- colour by -----------------------------------------------------------------------------------
  var choose = document.getElementById("colour");
  var keys = [];
  DATA.columns.forEach(function (c) { if (keys.indexOf(c.key) < 0) keys.push(c.key); });
  shownNodes.forEach(function (n) { Object.keys(n.stats || {}).forEach(function (k) { if (keys.indexOf(k) < 0) keys.push(k); }); });
  keys = keys.filter(function (k) { return shownNodes.some(function (n) { return numeric(valueOf(n, k)); }); });
  if (DATA.diff) keys.unshift("diff:" + (DATA.diff_label || "diff"));
  keys.forEach(function (k) {
    var o = document.createElement("option"); o.value = k; o.textContent = k; choose.appendChild(o);
  });
  function colourBy(key) {
    colourKey = key || "";
    range = colourKey ? computeRange(colourKey) : null;
    choose.value = colourKey;
    var legend = document.getElementById("scale");
    legend.textContent = range ? colourKey + ": " + fmt(range.lo) + " … " + fmt(range.hi) : "";
    draw();
  }
  choose.addEventListener("change", function () { colourBy(choose.value); });

  // -- findings --------------------------------------------------------------------------------------
  var findings = document.getElementById("findings");
  function finding(label, name, cls) {
    var b = document.createElement("button");
    b.className = "finding " + cls;
    b.textContent = label + ": " + name;
    b.setAttribute("data-finding", name);
    b.addEventListener("click", function () { reveal(name); });
    findings.appendChild(b);
  }
  if (DATA.first_nonfinite && byName[DATA.first_nonfinite]) finding("NaN/Inf origin", DATA.first_nonfinite, "origin");
  if (DATA.first_nonfinite_grad && byName[DATA.first_nonfinite_grad]) finding("gradient NaN/Inf origin", DATA.first_nonfinite_grad, "origin");
  shownNodes.forEach(function (n) { if (n.failed) finding("failed check", n.name, "failed"); });
  if (DATA.diff_first && byName[DATA.diff_first]) finding("first divergent", DATA.diff_first, "failed");
  if (!findings.childNodes.length) findings.textContent = "no NaN/Inf, no failed check";

  document.getElementById("title").textContent = DATA.model;
  document.getElementById("node-count").textContent = String(nodes.length);
  document.getElementById("op-count").textContent = String(shownNodes.length);
  document.getElementById("module-count").textContent = String(Object.keys(clusters).length - 1);

  if (DATA.diff) { colourKey = keys[0]; range = computeRange(colourKey); choose.value = colourKey; }
  draw();
  fit(0.6);
  window.fxdebugViewer = {
    expand: expand, collapse: collapse, reveal: reveal, search: search, colourBy: colourBy, select: select, fit: fit,
    nodeCount: function () { return nodes.length; },
    drawnNodes: function () { return Array.prototype.map.call(root.querySelectorAll("[data-node]"), function (e) { return e.getAttribute("data-node"); }); },
    drawnClusters: function () { return Array.prototype.map.call(root.querySelectorAll(".cluster.box"), function (e) { return e.getAttribute("data-cluster"); }); },
    lastLayoutMs: function () { return lastLayoutMs; },
    ready: true
  };
  document.body.setAttribute("data-ready", "1");
})();
