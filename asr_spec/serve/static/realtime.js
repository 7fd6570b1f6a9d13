// A client of /v1/realtime (vLLM's realtime protocol, docs/serve.md): opens the socket, asks for tentative text
// and lag events (how far behind the server is), sends PCM16 blocks as input_audio_buffer.append events and the final commit; calls back with the text.
"use strict";

const KEY_SUBPROTOCOL = "openai-insecure-api-key.";  // browsers cannot set headers on a WebSocket

function pcm16ToBase64(samples) {  // Int16Array -> base64 of its little-endian bytes
  const bytes = new Uint8Array(samples.buffer, samples.byteOffset, samples.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

class RealtimeClient {
  // handlers: {committed(text), tentative(text), lag(behindSeconds), done(text, usage), error(message),
  //            closed(reason)}
  constructor(handlers) {
    this.handlers = handlers;
    this.socket = null;
    this.committed = "";
  }

  open(apiKey) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const protocols = ["realtime"];
    if (apiKey) protocols.push(KEY_SUBPROTOCOL + apiKey);
    this.committed = "";
    return new Promise((resolve, reject) => {
      const socket = new WebSocket(`${scheme}//${location.host}/v1/realtime`, protocols);
      this.socket = socket;
      let created = false;
      socket.onmessage = (message) => {
        const event = JSON.parse(message.data);
        if (event.type === "session.created") {
          created = true;
          socket.send(JSON.stringify({type: "session.update", tentative: true, lag: true}));
          socket.send(JSON.stringify({type: "input_audio_buffer.commit"}));  // ready to start
          resolve();
        } else {
          this.dispatch(event);
        }
      };
      socket.onerror = () => { if (!created) reject(new Error("the server refused the connection")); };
      socket.onclose = (close) => {
        if (!created) reject(new Error(close.reason || `the server closed the connection (${close.code})`));
        this.handlers.closed(close.reason || `closed (${close.code})`);
      };
    });
  }

  dispatch(event) {
    if (event.type === "transcription.delta") {
      this.committed += event.delta;
      this.handlers.committed(this.committed);
    } else if (event.type === "transcription.tentative") {
      this.handlers.tentative(event.text);
    } else if (event.type === "transcription.lag") {
      this.handlers.lag(event.behind_s);
    } else if (event.type === "transcription.done") {
      this.committed = event.text;
      this.handlers.done(event.text, event.usage);
    } else if (event.type === "error") {
      this.handlers.error(event.error);
    }
  }

  append(samples) {  // Int16Array of 16 kHz mono samples
    if (this.socket && this.socket.readyState === WebSocket.OPEN) {
      this.socket.send(JSON.stringify({type: "input_audio_buffer.append", audio: pcm16ToBase64(samples)}));
    }
  }

  finish() {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) {
      this.socket.send(JSON.stringify({type: "input_audio_buffer.commit", final: true}));
    }
  }

  close() {
    if (this.socket) this.socket.close();
    this.socket = null;
  }
}
