// outbox-relay console: keeps a page's figures current by polling its JSON endpoint
// (body[data-api]) and asks for confirmation and the token before a retry or discard.
// No framework, nothing fetched from elsewhere.
"use strict";

(() => {
  const body = document.body;
  const mode = body.dataset.page;
  const api = body.dataset.api;
  const every = { overview: 3000, "dead-letters": 5000, message: 3000 }[mode] || 0;
  const tokenKey = "outbox-relay-console-token";
  const offline = document.getElementById("offline");
  const flash = document.getElementById("flash");
  let timer = null;
  let flashTimer = null;

  function say(text, bad) {
    flash.textContent = text;
    flash.className = bad ? "show bad" : "show";
    clearTimeout(flashTimer);
    flashTimer = setTimeout(() => { flash.className = ""; }, 8000);
  }

  function setValues(scope, values) {
    for (const [key, text] of Object.entries(values || {})) {
      for (const el of scope.querySelectorAll(`[data-k="${CSS.escape(key)}"]`)) {
        if (el.textContent !== text) el.textContent = text;
      }
    }
  }

  // A badge is ok or bad; a tile is highlighted while its flag is on.
  function setFlags(scope, flags) {
    for (const [key, on] of Object.entries(flags || {})) {
      for (const el of scope.querySelectorAll(`[data-flag="${CSS.escape(key)}"]`)) {
        if (el.classList.contains("badge")) {
          el.classList.toggle("ok", on);
          el.classList.toggle("bad", !on);
        } else {
          el.classList.toggle("warn", on);
        }
      }
    }
  }

  // Content under the keyboard focus or behind the dialog is left alone until it is free.
  function busy(container) {
    const dialog = document.getElementById("confirm");
    if (dialog && dialog.open) return true;
    return container.contains(document.activeElement) && document.activeElement !== container;
  }

  function applyOverview(data) {
    setValues(document, { broker: data.broker.text });
    setFlags(document, { broker: data.broker.up });
    const cards = document.querySelectorAll("section.outbox");
    if (cards.length !== data.outboxes.length) { location.reload(); return; }
    for (const o of data.outboxes) {
      const card = document.querySelector(`section.outbox[data-outbox="${CSS.escape(o.name)}"]`);
      if (!card) { location.reload(); return; }
      setValues(card, o.values);
      setFlags(card, o.flags);
      for (const [key, chart] of Object.entries(o.charts)) {
        const box = card.querySelector(`[data-chart="${CSS.escape(key)}"]`);
        if (!box) continue;
        box.querySelector("[data-cap]").textContent = chart.caption;
        box.querySelector("[data-scale]").textContent = chart.scale;
        const holder = box.querySelector("[data-svg]");
        if (holder.dataset.drawn !== chart.svg) {
          holder.innerHTML = chart.svg;
          holder.dataset.drawn = chart.svg;
        }
      }
    }
  }

  function applyDeadLetters(data, force) {
    setValues(document, data.values);
    const list = document.getElementById("dl-list");
    if (!list || list.dataset.items === data.items || (!force && busy(list))) return;
    const open = [...list.querySelectorAll("li.dl > details[open]")].map((d) => d.parentElement.dataset.id);
    list.innerHTML = data.items;
    list.dataset.items = data.items;
    for (const id of open) {
      const details = list.querySelector(`li.dl[data-id="${CSS.escape(id)}"] > details`);
      if (details) details.open = true;
    }
  }

  function applyMessage(data, force) {
    const holder = document.getElementById("message-body");
    if (!holder || holder.dataset.html === data.html || (!force && busy(holder))) return;
    holder.innerHTML = data.html;
    holder.dataset.html = data.html;
  }

  async function poll(force) {
    clearTimeout(timer);
    if (!api) return;
    if (!document.hidden || force) {
      try {
        const r = await fetch(api, {
          headers: { Accept: "application/json" },
          cache: "no-store",
          signal: AbortSignal.timeout(15000),
        });
        const data = await r.json();
        offline.hidden = true;
        if (r.status === 404) { location.reload(); return; }
        if (!r.ok) {
          offline.textContent = data.error || `The relay answered ${r.status}.`;
          offline.hidden = false;
        } else if (mode === "overview") {
          applyOverview(data);
        } else if (mode === "dead-letters") {
          applyDeadLetters(data, force);
        } else if (mode === "message") {
          applyMessage(data, force);
        }
      } catch (e) {
        offline.textContent = "Cannot reach the relay; the figures are not being updated. Retrying…";
        offline.hidden = false;
      }
    }
    timer = setTimeout(poll, every);
  }

  function focusHeading() {
    const h = document.querySelector("main h1");
    if (h) {
      h.tabIndex = -1;
      h.focus();
    }
  }

  async function act(url, token) {
    let r;
    try {
      r = await fetch(url, { method: "POST", headers: { Authorization: `Bearer ${token}`, Accept: "application/json" } });
    } catch (e) {
      say("Cannot reach the relay: nothing was sent.", true);
      return;
    }
    let data = {};
    try { data = await r.json(); } catch (e) { /* an answer without a body */ }
    if (r.ok) {
      sessionStorage.setItem(tokenKey, token);
      say(data.message || "Done.");
    } else {
      if (r.status === 403) sessionStorage.removeItem(tokenKey);
      say(data.error || `The relay answered ${r.status}.`, true);
    }
    focusHeading();
    poll(true);
  }

  function confirmAction(button) {
    const dialog = document.getElementById("confirm");
    if (!dialog) return;
    const input = document.getElementById("confirm-token");
    const ok = document.getElementById("confirm-ok");
    document.getElementById("confirm-text").textContent = button.dataset.confirm;
    ok.textContent = button.textContent;
    ok.className = button.classList.contains("danger") ? "danger" : "primary";
    input.value = sessionStorage.getItem(tokenKey) || "";
    dialog.returnValue = "";
    dialog.onclose = () => {
      if (dialog.returnValue === "ok") {
        act(button.dataset.action, input.value.trim());
      } else if (document.contains(button)) {
        button.focus();
      }
    };
    dialog.showModal();
    (input.value ? ok : input).focus();
  }

  document.addEventListener("click", (e) => {
    const button = e.target.closest("button[data-action]");
    if (!button) return;
    e.preventDefault();
    confirmAction(button);
  });

  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });

  if (api && every) timer = setTimeout(poll, every);
})();
