// A request page opened while its request runs: it watches the engine's snapshots and reloads once
// the request has left the engine, to show where its time went.
import { connect } from "./live.js";

const page = document.querySelector(".request-page");
const requestId = page.dataset.requestId;
let reloading = false;

connect(page.dataset.ws, (message) => {
  if (reloading || message.type !== "snapshot" || !message.live_requests) return;
  const stillLive = message.live_requests.some((r) => r.request_id === requestId);
  // A live list cut at its bound may leave it out while it runs: reload only on its end.
  const ended = (message.recent_requests || []).some((r) => r.request_id === requestId);
  if (!stillLive && (ended || message.live_total === message.live_requests.length)) {
    reloading = true;
    location.reload();
  }
});
