// A dashboard websocket that comes back: reconnects with backoff and shows its state in the header.

const indicator = () => document.getElementById("connection");

function showState(state, text) {
  document.body.dataset.live = state; // the page fades while what it shows may be stale
  const el = indicator();
  if (el) {
    el.dataset.state = state;
    el.textContent = text;
  }
}

/**
 * Open `path` (a /ws/engines/... route) and keep it open.
 * onMessage(obj) gets every JSON message; returns {send(obj) -> bool}.
 */
export function connect(path, onMessage) {
  let socket = null;
  let delay = 500;
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
      showState("retrying", `disconnected; reconnecting in ${seconds} s`);
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

/** Tokens/s from a counter that only grows (a drop means the engine was reset). */
export class Rate {
  constructor() {
    this.last = null;
  }

  update(value, at) {
    const last = this.last;
    this.last = { value, at };
    if (!last || at <= last.at || value < last.value) return null;
    return (value - last.value) / (at - last.at);
  }
}
