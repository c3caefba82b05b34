// The run page's live updates: server-sent events swap in the parts that changed
// and append new event-log rows. The HTML was rendered and escaped by the server.
(function () {
  "use strict";
  // A form with data-confirm (Cancel run) asks first; delegated, so a re-rendered form asks too.
  document.addEventListener("submit", function (event) {
    var form = event.target.closest ? event.target.closest("form[data-confirm]") : null;
    if (form && !window.confirm(form.dataset.confirm)) { event.preventDefault(); }
  });
  var data = document.getElementById("page-data");
  if (!data) { return; }
  var page = JSON.parse(data.textContent);
  if (!page.stream || !window.EventSource) { return; }
  var source = new EventSource(page.stream);
  source.addEventListener("open", function () { document.body.dataset.stream = "open"; });
  source.addEventListener("update", function (message) {
    var update = JSON.parse(message.data);
    Object.keys(update.parts).forEach(function (id) {
      var element = document.getElementById(id);
      if (element) { element.innerHTML = update.parts[id]; }
    });
    if (update.rows) {
      document.getElementById("event-rows").insertAdjacentHTML("beforeend", update.rows);
    }
    document.body.dataset.seq = String(update.seq);
    document.body.dataset.status = update.status;
  });
  source.addEventListener("end", function (message) {
    source.close();
    document.body.dataset.status = JSON.parse(message.data).status;
    document.body.dataset.stream = "ended";
  });
})();
