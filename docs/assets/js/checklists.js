// Tickable checklists. pymdownx.tasklist (custom_checkbox: true) renders `- [ ] item` as a
// disabled checkbox; this enables the boxes on pages that opt in (a `data-checklist` element
// anywhere in the article) and remembers each tick in this browser's localStorage, keyed by the
// page's path and the item's id: an empty `<span data-checklist-id="ex-16"></span>` at the start
// of the item, so rewording or reordering items keeps their state. An item without an id is keyed
// by its text. A tick stored under an item's text (as before ids existed) moves to its id the
// first time the page is wired up. Nothing leaves the browser.
// document$ (Material) re-fires after every instant-navigation page change, so the boxes of a
// page reached by a link are wired up too, not only those of the first page loaded.
(function () {
  const PREFIX = "checklist:";

  function itemText(li) {
    const copy = li.cloneNode(true);
    copy.querySelectorAll("ul, ol, label").forEach((n) => n.remove()); // nested lists, the box
    return copy.textContent.replace(/\s+/g, " ").trim();
  }

  function pageKey() {
    return PREFIX + window.location.pathname.replace(/index\.html$/, "") + "::";
  }

  function itemId(li) {
    const marker = li.querySelector(":scope > [data-checklist-id], :scope > p > [data-checklist-id]");
    return marker ? marker.dataset.checklistId : null;
  }

  function storageKey(li) {
    const id = itemId(li);
    return pageKey() + (id ? "#" + id : itemText(li));
  }

  // A tick stored under the item's text, from before the item had an id: move it to the id.
  function migrate(li) {
    if (!itemId(li)) return;
    const old = pageKey() + itemText(li);
    try {
      if (window.localStorage.getItem(old) === null) return;
      if (window.localStorage.getItem(old) === "1") window.localStorage.setItem(storageKey(li), "1");
      window.localStorage.removeItem(old);
    } catch (err) {
      /* storage blocked: nothing to move */
    }
  }

  function read(key) {
    try {
      return window.localStorage.getItem(key) === "1";
    } catch (err) {
      return false; // storage blocked (private mode, file:// in some browsers): still tickable
    }
  }

  function write(key, checked) {
    try {
      if (checked) window.localStorage.setItem(key, "1");
      else window.localStorage.removeItem(key);
    } catch (err) {
      /* not persisted; the tick stays for this visit */
    }
  }

  function updateProgress(article) {
    const boxes = article.querySelectorAll(".task-list-item input[type=checkbox]");
    const done = Array.from(boxes).filter((b) => b.checked).length;
    article.querySelectorAll("[data-checklist-progress]").forEach((el) => {
      el.textContent = done + " of " + boxes.length + " ticked";
    });
  }

  function wire(root) {
    const article = root.querySelector("article") || root;
    if (!article.querySelector("[data-checklist]")) return;
    article.querySelectorAll(".task-list-item").forEach((li) => {
      const box = li.querySelector(":scope > label > input[type=checkbox], :scope > input[type=checkbox]");
      if (!box || box.dataset.checklistWired) return;
      migrate(li);
      const key = storageKey(li);
      box.disabled = false;
      box.checked = read(key);
      box.dataset.checklistWired = "1";
      box.addEventListener("change", () => {
        write(key, box.checked);
        updateProgress(article);
      });
    });
    article.querySelectorAll("[data-checklist-reset]").forEach((button) => {
      if (button.dataset.checklistWired) return;
      button.dataset.checklistWired = "1";
      button.addEventListener("click", () => {
        article.querySelectorAll(".task-list-item input[type=checkbox]").forEach((box) => {
          box.checked = false;
          write(storageKey(box.closest(".task-list-item")), false);
        });
        updateProgress(article);
      });
    });
    updateProgress(article);
  }

  if (typeof document$ !== "undefined") {
    document$.subscribe(({ body }) => wire(body));
  } else {
    document.addEventListener("DOMContentLoaded", () => wire(document.body));
  }
})();
