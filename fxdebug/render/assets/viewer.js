/* fxdebug interactive graph viewer.
 *
 * Reads the graph from <script id="fxdebug-data" type="application/json"> and draws it with
 * dagre's layout. Module clusters start collapsed (one box each) below the levels that fit; a click
 * on a box expands it, a click on an open cluster's title collapses it.
 *
 * Scale: every open cluster is laid out on its own, as a small flat graph of its direct items (its
 * nodes, and its child clusters as boxes of their own size), and the layouts nest. dagre therefore
 * never sees more than CHUNK items at once, however large the graph: a cluster with more items
 * than that (a long nn.Sequential: thousands of children) shows them in closed runs of CHUNK, and
 * runs of runs. A layout that is a plain chain is a column, laid out in linear time without dagre. Runs of identical sibling blocks (``layers.0–79 ×80``) are one box until opened; a
 * block holding a finding stays out of the run. A source that feeds many items of one layout (rotary
 * cos/sin, an attention mask) is drawn once, with one edge and a "feeds N" line. An action lays out
 * again only the clusters it changed and their ancestors; the rest come from a cache. Auto-open is
 * bounded in boxes and in depth. If dagre fails on a layout, that layout falls back to a column.
 *
 * window.fxdebugViewer exposes the same actions the page's controls use (expand, collapse, reveal,
 * search, colourBy), for scripts and tests.
 */
(function () {
  "use strict";
  var T0 = performance.now();
  var DATA = JSON.parse(document.getElementById("fxdebug-data").textContent);
  var timings = {parse: performance.now() - T0};
  var SVGNS = "http://www.w3.org/2000/svg";
  var AUTO_OPEN = 60;  // expand clusters breadth-first while fewer boxes than this are visible ...
  var AUTO_DEPTH = 6;  // ... and no deeper than this many levels
  var CHUNK = 100;     // a cluster with more than CHUNK items shows them in closed runs of CHUNK
  var FAN = 6;         // a source feeding more items than this in one layout is drawn with one edge
  var TITLE = 22;      // height of an open cluster's title bar
  var LINE = 14, CHAR = 6.6, PAD = 8;

  // -- the cluster tree ----------------------------------------------------------------------------
  // Items are nodes and clusters; each has .parent (a cluster), .id and .first (graph index).
  var nodes = DATA.nodes;
  var byName = {};
  var STRINGS = DATA.strings || [];
  function str(v) { return typeof v === "number" ? STRINGS[v] : v; }
  nodes.forEach(function (n, i) {  // repeated strings come as indexes; fields at their defaults are left out
    n.index = i; byName[n.name] = n; n.id = "n:" + n.name;
    n.ci = n.cluster;
    n.module = str(n.module) || ""; n.cluster = str(n.cluster) || "";
    n.op = str(n.op); n.kind = str(n.kind); n.module_type = str(n.module_type); n.dtype = str(n.dtype);
    if (!n.inputs) n.inputs = [];
  });
  function newCluster(path, parent, first) {
    return {path: path, parent: parent, items: [], count: 0, depth: 0, first: first, isCluster: true,
            id: "c:" + path, virtual: false, title: null, layout: null, dirty: true};
  }
  var clusters = {"": newCluster("", null, 0)};
  function cluster(path, first) {
    if (clusters[path]) return clusters[path];
    var cut = path.lastIndexOf(".");
    var parent = cluster(cut < 0 ? "" : path.slice(0, cut), first);
    var c = newCluster(path, parent, first);
    clusters[path] = c;
    parent.items.push(c);
    return c;
  }
  var shownNodes = nodes.filter(function (n) { return !n.hidden; });
  var clusterAt = {};  // by the page's path index: no long path is hashed once per node
  shownNodes.forEach(function (n) {
    var c = clusterAt[n.ci] || (clusterAt[n.ci] = cluster(n.cluster, n.index));
    n.parent = c;
    c.items.push(n);
  });
  function lastPart(path) { return path.slice(path.lastIndexOf(".") + 1); }
  function virtualCluster(parent, label, members, title) {
    var path = (parent.path ? parent.path + "." : "") + label;
    var v = newCluster(path, parent, members[0].first !== undefined ? members[0].first : members[0].index);
    v.virtual = true;
    v.title = title || path;
    v.items = members;
    members.forEach(function (m) { m.parent = v; });
    clusters[path] = v;
    return v;
  }
  function firstOf(it) { return it.isCluster ? it.first : it.index; }

  // Runs of identical sibling blocks (computed by fxdebug.render.fold from the ops and their wiring).
  (DATA.folds || []).forEach(function (run) {
    var cs = run.map(function (p) { return clusters[p]; });
    if (cs.length < 2 || cs.some(function (c) { return !c || c.virtual || c.parent !== cs[0].parent; })) return;
    var parent = cs[0].parent;
    var members = {};
    cs.forEach(function (c) { members[c.path] = true; });
    var at = parent.items.indexOf(cs[0]);
    var label = "(" + lastPart(run[0]) + "–" + lastPart(run[run.length - 1]) + " ×" + run.length + ")";
    var fold = virtualCluster(parent, label, cs, run[0] + "–" + lastPart(run[run.length - 1]) + " ×" + run.length);
    fold.fold = run.length;
    fold.type = DATA.modules[run[0]];
    var kept = parent.items.filter(function (it) { return !(it.isCluster && members[it.path]); });
    kept.splice(Math.min(at, kept.length), 0, fold);
    parent.items = kept;
  });

  // Long clusters: runs of CHUNK items, then runs of runs, until a layout holds at most CHUNK items.
  function chunk(c) {
    var spans = c.items.map(function (it, i) { return [i + 1, i + 1]; });  // item numbers each entry covers
    while (c.items.length > CHUNK) {
      var out = [], outSpans = [];
      for (var s = 0; s < c.items.length; s += CHUNK) {
        var members = c.items.slice(s, s + CHUNK), span = [spans[s][0], spans[Math.min(s + CHUNK, spans.length) - 1][1]];
        if (members.length === 1) { out.push(members[0]); outSpans.push(span); continue; }  // a run of one is the item
        var allNodes = members.every(function (it) { return !it.isCluster || it.allNodes; });
        var label = "(" + (allNodes ? "nodes " : "items ") + span[0] + "–" + span[1] + ")";
        var v = virtualCluster(c, label, members, (c.path ? c.path + " " : "") + label);
        v.allNodes = allNodes;
        out.push(v);
        outSpans.push(span);
      }
      c.items = out;
      spans = outSpans;
    }
  }
  Object.keys(clusters).forEach(function (p) { chunk(clusters[p]); });

  // Depths (iteratively: nesting can be deep), counts and findings.
  var order = [clusters[""]];
  for (var qi = 0; qi < order.length; qi++) {
    order[qi].items.forEach(function (it) {
      if (it.isCluster) { it.depth = order[qi].depth + 1; order.push(it); }
      else it.depth = order[qi].depth + 1;
    });
  }
  function isFinding(n) { return n.origin || n.grad_origin || n.failed; }
  shownNodes.forEach(function (n) {  // each node marks its own cluster; then one pass carries it all up
    var c = n.parent;
    c.count += 1;
    if (n.nonfinite) c.nonfinite = true;
    if (isFinding(n) && !c.finding) c.finding = n;
    if (n.origin || n.grad_origin) c.origin = true;
    if (n.failed) c.failed = true;
    if (n.dead) c.dead = true;
  });
  for (var oi = order.length - 1; oi > 0; oi--) {
    var k = order[oi], up = k.parent;
    up.count += k.count;
    up.nonfinite = up.nonfinite || k.nonfinite;
    if (k.finding && (!up.finding || k.finding.index < up.finding.index)) up.finding = k.finding;
    up.origin = up.origin || k.origin;
    up.failed = up.failed || k.failed;
    up.dead = up.dead || k.dead;
  }

  // Every edge belongs to one layout: the cluster holding both ends' items (their lowest common ancestor).
  var edgesAt = {};
  function lift(a, b) {
    while (a.depth > b.depth) a = a.parent;
    while (b.depth > a.depth) b = b.parent;
    while (a.parent !== b.parent) { a = a.parent; b = b.parent; }
    return a === b ? null : [a, b];
  }
  shownNodes.forEach(function (v) {
    v.inputs.forEach(function (i) {
      var u = nodes[i];
      if (!u || u.hidden) return;
      var e = lift(u, v);
      if (!e) return;
      var key = e[0].parent.path;
      (edgesAt[key] = edgesAt[key] || []).push(e);
    });
  });

  timings.tree = performance.now() - T0 - timings.parse;
  var expanded = {"": true};
  function isPlumbing(c) { return !c.virtual && lastPart(c.path).indexOf("(mask") === 0; }
  (function autoOpen() {
    var visible = clusters[""].items.length;
    var queue = clusters[""].items.filter(function (it) { return it.isCluster; });
    for (var i = 0; i < queue.length; i++) {
      var c = queue[i];
      if (c.virtual || isPlumbing(c) || c.depth > AUTO_DEPTH) continue;  // runs, folds and plumbing open on demand
      var grow = c.items.length - 1;
      if (visible + grow > AUTO_OPEN) continue;
      expanded[c.path] = true;
      visible += grow;
      c.items.forEach(function (it) { if (it.isCluster) queue.push(it); });
    }
  })();
  function dirtyUp(c) { for (; c; c = c.parent) c.dirty = true; }
  function setOpen(c, open) {
    if (!!expanded[c.path] === open) return;
    if (open) expanded[c.path] = true; else delete expanded[c.path];
    dirtyUp(c.parent);
  }

  // -- colour -------------------------------------------------------------------------------------
  var colourKey = "";
  var range = null;
  var clusterValues = {};
  function numeric(v) { return typeof v === "number" && isFinite(v); }
  function valueOf(n, key) {
    if (key.indexOf("diff:") === 0) return DATA.diff ? DATA.diff[n.name] : undefined;
    return n.stats ? n.stats[key] : undefined;
  }
  function computeRange(key) {
    if (key.indexOf("diff:") === 0) return {lo: 0, hi: 1};  // scores: divergence / (10 rtol), capped at 1
    var lo = Infinity, hi = -Infinity;
    shownNodes.forEach(function (n) { var v = valueOf(n, key); if (numeric(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
    return lo <= hi ? {lo: lo, hi: hi} : null;
  }
  function heat(v) {
    if (!range || !numeric(v)) return null;
    var t = range.hi > range.lo ? (v - range.lo) / (range.hi - range.lo) : 1;
    var r = 255, g = Math.round(245 - 170 * t), b = Math.round(235 - 215 * t);
    return "rgb(" + r + "," + g + "," + b + ")";
  }
  function computeClusterValues(key) {
    clusterValues = {};
    if (!key) return;
    shownNodes.forEach(function (n) {
      var v = valueOf(n, key), p = n.parent.path;
      if (numeric(v) && (!(p in clusterValues) || v > clusterValues[p])) clusterValues[p] = v;
    });
    for (var i = order.length - 1; i > 0; i--) {
      var k = order[i], v = clusterValues[k.path], up = k.parent.path;
      if (numeric(v) && (!(up in clusterValues) || v > clusterValues[up])) clusterValues[up] = v;
    }
  }
  function findingClass(x) {
    if (x.origin || x.grad_origin) return "origin";
    if (x.failed) return "failed";
    if (x.nonfinite) return "nonfinite";
    if (x.dead) return "dead";
    return "";
  }

  // -- layout --------------------------------------------------------------------------------------
  var svg = document.getElementById("canvas");
  var root = document.createElementNS(SVGNS, "g");
  svg.appendChild(root);
  var view = {x: 0, y: 0, k: 1};
  var selected = null;
  var lastLayoutMs = 0, layoutsRun = 0, largestLayout = 0;

  function el(tag, attrs, parent) {
    var e = document.createElementNS(SVGNS, tag);
    for (var a in attrs) e.setAttribute(a, attrs[a]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (!isFinite(v)) return String(v);
    if (v === Math.round(v) && Math.abs(v) < 1e6) return String(v);
    var a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e4) ? v.toExponential(2) : v.toPrecision(4).replace(/\.?0+$/, "");
  }
  function shapeText(s) { return s ? "(" + s.map(function (d) { return d === null ? "?" : d; }).join(", ") + ")" : ""; }
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
  function clusterTitle(c) {
    if (c.fold) return c.title + (c.type ? " : " + c.type : "");
    if (c.virtual) return c.title;
    var typ = DATA.modules[c.path];
    return c.path + (typ ? " : " + typ : "");
  }
  function clusterLines(c) {
    var lines = [clusterTitle(c), c.count + " nodes" + (c.fold ? " in " + c.fold + " identical blocks" : "") + "  [+]"];
    if (c.finding) lines.push((c.finding.failed && !c.finding.origin ? "FAILED: " : "ORIGIN inside: ") + c.finding.name);
    else if (c.nonfinite) lines.push("NaN/Inf inside");
    if (colourKey && numeric(clusterValues[c.path])) lines.push("max " + colourKey + " " + fmt(clusterValues[c.path]));
    return lines;
  }
  function boxSize(lines) {
    var w = 0;
    lines.forEach(function (l) { w = Math.max(w, l.length); });
    return {width: Math.min(420, w * CHAR + 2 * PAD), height: lines.length * LINE + PAD};
  }

  function edgesOf(c) {
    // this layout's edges (deduplicated) and its fans: a source feeding more than FAN items keeps one edge
    var raw = edgesAt[c.path] || [], seen = {}, bySrc = {}, list = [];
    raw.forEach(function (e) {
      var key = e[0].id + ">" + e[1].id;
      if (seen[key]) return;
      seen[key] = true;
      (bySrc[e[0].id] = bySrc[e[0].id] || []).push(e);
    });
    var fans = {};
    Object.keys(bySrc).forEach(function (src) {
      var out = bySrc[src];
      if (out.length > FAN) {
        out.sort(function (a, b) { return firstOf(a[1]) - firstOf(b[1]); });
        fans[src] = out.length;
        list.push(out[0]);
      } else list.push.apply(list, out);
    });
    return {list: list, fans: fans};
  }
  function columnLayout(items, sizes, edges) {
    // the fallback: one column, in graph order (never fails, never recurses)
    var pos = {}, y = 12, w = 0;
    items.forEach(function (it) { w = Math.max(w, sizes[it.id].width); });
    items.forEach(function (it) {
      var s = sizes[it.id];
      pos[it.id] = {x: 12 + w / 2, y: y + s.height / 2, width: s.width, height: s.height};
      y += s.height + 20;
    });
    var lines = edges.map(function (e) {
      var a = pos[e[0].id], b = pos[e[1].id];
      return [{x: a.x, y: a.y + a.height / 2}, {x: b.x, y: b.y - b.height / 2}];
    });
    return {width: w + 24, height: y, pos: pos, edges: lines};
  }
  function layoutCluster(c) {
    if (c.layout && !c.dirty) return c.layout;
    var items = c.items, sizes = {};
    var edges = edgesOf(c);
    items.forEach(function (it) {
      if (it.isCluster && expanded[it.path]) {
        var inner = layoutCluster(it);
        var title = "[−] " + clusterTitle(it) + (edges.fans[it.id] ? " — feeds " + edges.fans[it.id] + " of these (drawn once)" : "");
        sizes[it.id] = {width: Math.max(inner.width, title.length * CHAR + 24), height: inner.height + TITLE, open: true, title: title};
      } else {
        var lines = it.isCluster ? clusterLines(it) : nodeLines(it);
        if (edges.fans[it.id]) lines.push("feeds " + edges.fans[it.id] + " of these (drawn once)");
        var s = boxSize(lines);
        sizes[it.id] = {width: s.width, height: s.height, lines: lines};
      }
    });
    var result, at = {};
    items.forEach(function (it, i) { at[it.id] = i; });
    var chain = edges.list.every(function (e) { return at[e[1].id] === at[e[0].id] + 1; });
    if (chain) {  // a plain chain (a long Sequential): a column is dagre's answer, in linear time
      result = columnLayout(items, sizes, edges.list);
    } else try {
      var g = new dagre.graphlib.Graph({multigraph: false});
      g.setGraph({rankdir: "TB", nodesep: 18, ranksep: 28, marginx: 12, marginy: 12});
      g.setDefaultEdgeLabel(function () { return {}; });
      items.forEach(function (it) { g.setNode(it.id, {width: sizes[it.id].width, height: sizes[it.id].height}); });
      edges.list.forEach(function (e) { g.setEdge(e[0].id, e[1].id, {}); });
      // Parts with no edge between them (eager code between captured parts, a side box) stack top to
      // bottom in execution order instead of standing side by side: an unseen edge joins each to the next.
      var root = {};
      function find(id) { while (root[id] !== id) id = root[id] = root[root[id]]; return id; }
      items.forEach(function (it) { root[it.id] = it.id; });
      edges.list.forEach(function (e) { root[find(e[0].id)] = find(e[1].id); });
      var comps = [], seenComp = {};
      items.forEach(function (it, i) {
        var r = find(it.id);
        if (!(r in seenComp)) { seenComp[r] = comps.length; comps.push({first: it.id, last: it.id}); }
        comps[seenComp[r]].last = it.id;
      });
      for (var ci = 1; ci < comps.length; ci++) {
        if (!g.hasEdge(comps[ci - 1].last, comps[ci].first)) g.setEdge(comps[ci - 1].last, comps[ci].first, {unseen: true});
      }
      dagre.layout(g);
      var pos = {};
      items.forEach(function (it) { var d = g.node(it.id); pos[it.id] = {x: d.x, y: d.y, width: d.width, height: d.height}; });
      var lines = g.edges().filter(function (e) { return !g.edge(e).unseen; }).map(function (e) { return g.edge(e).points || []; });
      var gg = g.graph();
      result = {width: gg.width || 40, height: gg.height || 20, pos: pos, edges: lines};
    } catch (err) {
      if (window.console) console.warn("fxdebug viewer: dagre failed on " + (c.path || "<root>") + " (" + err + "); one column instead");
      result = columnLayout(items, sizes, edges.list);
    }
    result.sizes = sizes;
    c.layout = result;
    c.dirty = false;
    layoutsRun += 1;
    largestLayout = Math.max(largestLayout, items.length);
    return result;
  }

  // -- drawing -------------------------------------------------------------------------------------
  function draw() {
    var t0 = performance.now();
    var top = layoutCluster(clusters[""]);
    lastLayoutMs = performance.now() - t0;
    while (root.firstChild) root.removeChild(root.firstChild);
    var layerClusters = el("g", {"class": "clusters"}, root);
    var layerEdges = el("g", {"class": "edges"}, root);
    var layerNodes = el("g", {"class": "nodes"}, root);
    var count = 0, boxes = 0;
    var stack = [[clusters[""], 0, 0]];
    while (stack.length) {  // iterative: nesting can be deep
      var frame = stack.pop(), c = frame[0], ox = frame[1], oy = frame[2], L = c.layout;
      L.edges.forEach(function (pts) {
        if (!pts.length) return;
        var dstr = "M" + pts.map(function (p) { return (p.x + ox).toFixed(1) + "," + (p.y + oy).toFixed(1); }).join(" L");
        el("path", {d: dstr, "class": "edge", "marker-end": "url(#arrow)"}, layerEdges);
      });
      c.items.forEach(function (it) {
        var p = L.pos[it.id], s = L.sizes[it.id];
        var x0 = ox + p.x - p.width / 2, y0 = oy + p.y - p.height / 2;
        if (s.open) {
          var grp = el("g", {"class": "cluster open " + findingClass(it), "data-cluster": it.path}, layerClusters);
          el("rect", {x: x0, y: y0, width: p.width, height: p.height, rx: 6}, grp);
          var title = el("text", {x: x0 + 8, y: y0 + 15, "class": "ctitle"}, grp);
          title.textContent = s.title;
          title.addEventListener("click", function (ev) { ev.stopPropagation(); collapse(it.path); });
          stack.push([it, x0 + (p.width - it.layout.width) / 2, y0 + TITLE]);
          return;
        }
        var fill = null, grp2;
        if (!it.isCluster) {
          count += 1;
          grp2 = el("g", {"class": "node " + findingClass(it) + (it.kind === "placeholder" || it.kind === "output" ? " io" : "")
            + (selected === it.name ? " selected" : ""), "data-node": it.name}, layerNodes);
          if (colourKey) fill = heat(valueOf(it, colourKey));
          grp2.addEventListener("click", function (ev) { ev.stopPropagation(); select(it.name); });
          el("title", {}, grp2).textContent = it.name + " (" + (it.module || "<root>") + ")";
        } else {
          boxes += 1;
          grp2 = el("g", {"class": "cluster box " + findingClass(it) + (it.virtual ? " run" : ""), "data-cluster": it.path}, layerNodes);
          if (colourKey) fill = heat(clusterValues[it.path]);
          grp2.addEventListener("click", function (ev) { ev.stopPropagation(); expand(it.path); });
          el("title", {}, grp2).textContent = "click to expand " + clusterTitle(it);
        }
        var rect = el("rect", {x: x0, y: y0, width: p.width, height: p.height, rx: it.isCluster ? 2 : 4}, grp2);
        if (fill && !/origin|failed/.test(grp2.getAttribute("class"))) rect.setAttribute("style", "fill:" + fill);
        s.lines.forEach(function (line, i) {
          var t = el("text", {x: x0 + PAD, y: y0 + PAD / 2 + LINE * (i + 1) - 3}, grp2);
          t.textContent = line;
        });
      });
    }
    svg.setAttribute("data-width", Math.round(top.width || 0));
    svg.setAttribute("data-height", Math.round(top.height || 0));
    document.getElementById("visible").textContent = "drawn: " + count + " nodes, " + boxes + " closed modules ("
      + Math.round(lastLayoutMs) + " ms layout)";
    applyView();
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
    // the whole picture on screen, or (minScale) no smaller than that: centred when it fits, else from
    // the top-left corner (where the inputs are), never off the left edge
    var gw = +svg.getAttribute("data-width"), gh = +svg.getAttribute("data-height");
    var r = svg.getBoundingClientRect();
    if (!gw || !gh || !r.width || !r.height) return;
    var floor = typeof minScale === "number" ? minScale : 0.05;
    view.k = Math.max(floor, Math.min(1.5, Math.min(r.width / gw, r.height / gh)));
    view.x = Math.max(10, (r.width - gw * view.k) / 2);
    if (gw * view.k + 20 > r.width) view.x = 10;
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
  function openChain(c) { for (; c; c = c.parent) setOpen(c, true); }
  // Opening a box also opens the boxes inside it that hold a single item (a live graph's ``conv``,
  // ``act``: a box of one op hides nothing and costs a click), no more than AUTO_DEPTH levels down (a
  // deep chain of one-child modules stays a click per AUTO_DEPTH levels); larger ones stay boxes, as
  // do runs, folds and plumbing.
  function openBelow(c) {
    var queue = c.items.filter(function (it) { return it.isCluster; });
    for (var i = 0; i < queue.length; i++) {
      var k = queue[i];
      if (k.virtual || isPlumbing(k) || k.items.length !== 1 || k.depth - c.depth > AUTO_DEPTH) continue;
      setOpen(k, true);
      k.items.forEach(function (it) { if (it.isCluster) queue.push(it); });
    }
  }
  function expand(path) {
    var c = clusters[path];
    if (!c) return false;
    openChain(c);
    openBelow(c);
    draw();
    centre('[data-cluster="' + cssEscape(path) + '"]');
    return true;
  }
  function collapse(path) {
    var c = clusters[path];
    if (!c || path === "") return false;
    var below = [c];
    for (var i = 0; i < below.length; i++) {
      var k = below[i];
      if (expanded[k.path]) setOpen(k, false);
      k.items.forEach(function (it) { if (it.isCluster && expanded[it.path]) below.push(it); });
    }
    draw();
    centre('[data-cluster="' + cssEscape(path) + '"]');
    return true;
  }
  function reveal(name) {
    var n = byName[name];
    if (!n || n.hidden) return false;
    openChain(n.parent);
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
    if (n.shape) row(t, "shape", [shapeText(n.shape), n.dtype, n.device].filter(Boolean).join(" "));
    if (n.origin) row(t, "finding", "NaN/Inf ORIGIN: first node that turned finite inputs into NaN/Inf", "bad");
    if (n.grad_origin) row(t, "finding", "NaN/Inf gradient ORIGIN", "bad");
    if (n.failed) row(t, "FAILED", n.failed, "bad");
    (n.params || []).forEach(function (p) { row(t, "reads", p[0] + " " + shapeText(p[1])); });
    (n.inputs || []).forEach(function (i) { var s = nodes[i]; row(t, "input", s.name + " " + shapeText(s.shape)); });
    var stats = n.stats || {};
    DATA.columns.forEach(function (col) {
      if (col.key in stats && stats[col.key] !== null) row(t, col.label || col.key, fmt(stats[col.key]));
    });
    Object.keys(stats).sort().forEach(function (k) {
      if (stats[k] !== null && !DATA.columns.some(function (c) { return c.key === k; })) row(t, k, fmt(stats[k]));
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
  var keys = [], seenKey = {};
  function addKey(k) { if (!seenKey[k]) { seenKey[k] = true; keys.push(k); } }
  DATA.columns.forEach(function (c) { addKey(c.key); });
  var numericKey = {};
  shownNodes.forEach(function (n) {
    var st = n.stats || {};
    for (var k in st) { addKey(k); if (numeric(st[k])) numericKey[k] = true; }
  });
  keys = keys.filter(function (k) { return numericKey[k]; });
  if (DATA.diff) keys.unshift("diff:" + (DATA.diff_label || "diff"));
  keys.forEach(function (k) {
    var o = document.createElement("option"); o.value = k; o.textContent = k; choose.appendChild(o);
  });
  function colourBy(key) {
    colourKey = key || "";
    range = colourKey ? computeRange(colourKey) : null;
    computeClusterValues(colourKey);
    choose.value = colourKey;
    var legend = document.getElementById("scale");
    legend.textContent = range ? colourKey + ": " + fmt(range.lo) + " … " + fmt(range.hi) : "";
    Object.keys(clusters).forEach(function (p) { clusters[p].dirty = true; });  // every box's lines change
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

  document.getElementById("title").textContent = DATA.model || "";
  document.getElementById("node-count").textContent = String(nodes.length);
  document.getElementById("op-count").textContent = String(shownNodes.length);
  document.getElementById("module-count").textContent = String(Object.keys(clusters).filter(function (p) {
    return p && !clusters[p].virtual && !isPlumbing(clusters[p]);
  }).length);

  if (DATA.diff) { colourKey = keys[0]; range = computeRange(colourKey); computeClusterValues(colourKey); choose.value = colourKey; }
  try {
    draw();
  } catch (err) {  // never a blank page: say what failed where the picture would be
    var msg = el("text", {x: 20, y: 40, "class": "error"}, root);
    msg.textContent = "fxdebug viewer: drawing failed (" + err + "); search and the findings still work.";
    throw err;
  } finally {
    fit(0.6);
    timings.total = performance.now() - T0;
  }
  window.fxdebugViewer = {
    expand: expand, collapse: collapse, reveal: reveal, search: search, colourBy: colourBy, select: select, fit: fit,
    nodeCount: function () { return nodes.length; },
    drawnNodes: function () { return Array.prototype.map.call(root.querySelectorAll("[data-node]"), function (e) { return e.getAttribute("data-node"); }); },
    drawnClusters: function () { return Array.prototype.map.call(root.querySelectorAll(".cluster.box"), function (e) { return e.getAttribute("data-cluster"); }); },
    openClusters: function () { return Object.keys(expanded).filter(function (p) { return p; }); },
    clusterOf: function (name) { var n = byName[name]; return n && n.parent ? n.parent.path : null; },
    lastLayoutMs: function () { return lastLayoutMs; },
    layoutStats: function () { return {layouts: layoutsRun, largest: largestLayout}; },
    view: function () { return {x: view.x, y: view.y, k: view.k}; },
    timings: function () { return timings; },
    ready: true
  };
  document.body.setAttribute("data-ready", "1");
})();
