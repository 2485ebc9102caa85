// A dashboard websocket that comes back: reconnects with backoff and shows its state in the header,
// and whether the snapshots it carries arrive (the server's `feed` messages).
import { timeOfDay } from "./format.js";

const indicator = () => document.getElementById("connection");

function showIndicator(state, text) {
  const el = indicator();
  if (el) {
    el.dataset.state = state;
    el.textContent = text;
  }
}

function showState(state, text) {
  document.body.dataset.live = state; // the page fades while what it shows may be stale
  showIndicator(state, text);
}

/**
 * The server's word on the snapshots (`feed`): while the channel layer that carries them does not
 * answer, the page says so over its figures (#feed-notice) and fades them (body[data-feed]); the
 * next `live` clears both. `lastAt` is the newest snapshot's time, what the figures show.
 */
function showFeed(message, lastAt) {
  const interrupted = message.state === "interrupted";
  document.body.dataset.feed = message.state;
  const notice = document.getElementById("feed-notice");
  if (notice) {
    notice.hidden = !interrupted;
    const since = lastAt ? timeOfDay(lastAt) : "before this page opened";
    notice.textContent = interrupted ? `The live feed is interrupted: ${message.reason}. The figures below are ` +
      `from ${since}; they come back by themselves when it answers.` : "";
  }
  showIndicator(interrupted ? "interrupted" : "open", interrupted ? "live feed interrupted" : "live");
}

/**
 * Open `path` (a /ws/engines/... route) and keep it open.
 * onMessage(obj) gets every JSON message; returns {send(obj) -> bool}.
 */
export function connect(path, onMessage) {
  let socket = null;
  let delay = 500;
  let lastAt = null; // the newest snapshot's time (Unix s)
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}${path}`;

  function open() {
    showState("connecting", "connecting…");
    socket = new WebSocket(url);
    socket.addEventListener("open", () => {
      delay = 500;
      showState("open", "live");
    });
    socket.addEventListener("message", (event) => {
      let message;
      try {
        message = JSON.parse(event.data);
      } catch {
        return;
      }
      if (message.type === "feed") {
        showFeed(message, lastAt);
        return;
      }
      if (message.type === "snapshot") lastAt = Math.max(lastAt || 0, message.at);
      onMessage(message);
    });
    socket.addEventListener("close", (event) => {
      if (event.code === 4403) {
        showState("closed", "signed out: reload the page to sign in");
        return;
      }
      if (event.code === 4404) {
        showState("closed", "this engine is not served any more");
        return;
      }
      const seconds = Math.round(delay / 100) / 10;
      // 4503: the database that holds the session does not answer; it is asked again, as after a drop.
      const why = event.code === 4503 ? "the database does not answer" : "disconnected";
      showState("retrying", `${why}; reconnecting in ${seconds} s`);
      setTimeout(open, delay);
      delay = Math.min(delay * 2, 15000);
    });
  }

  open();
  return {
    send(message) {
      if (!socket || socket.readyState !== WebSocket.OPEN) return false;
      socket.send(JSON.stringify(message));
      return true;
    },
  };
}
