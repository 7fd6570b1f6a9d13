// The page: microphone capture (getUserMedia + the pcm16 AudioWorklet) or a file streamed at real-time pace,
// both through RealtimeClient; committed text and the tentative rest shown apart. body[data-state] says where a
// session is: idle, streaming, finishing, done, error (the browser test waits on it); body[data-lag] is "behind"
// while the server reports it is catching up (transcription.lag), shown as a small note beside the status.
"use strict";

const RATE = 16000;
const BLOCK_MS = 100;  // a file is sent in blocks of this much audio, one per BLOCK_MS of wall time
const LAG_SHOWN_S = 1.0;  // the server is shown as catching up from this much audio waiting (its own threshold)
const $ = (id) => document.getElementById(id);
// The input running or last run: {client, capture ({context, node, media} while the microphone runs), timer (the
// file's block timer), ended}. Each feeds its own client. One ends at its done, an error event, its connection's
// close, or the next Start: then nothing more is sent, and what its client still reports changes nothing.
let session = null;

function setState(state, status) {
  document.body.dataset.state = state;
  if (status !== undefined) $("status").textContent = status;
  const busy = state === "streaming" || state === "finishing";
  $("mic-start").disabled = busy;
  $("mic-stop").disabled = !(busy && session && session.capture);
  $("file-start").disabled = busy || !$("file").files.length;
}

function show(own, state, status) {  // the page's state, when `own` is the current session
  if (own === session) setState(state, status);
}

function newSession() {
  if (session) endSession(session);
  $("committed").textContent = "";
  $("tentative").textContent = "";
  const own = {client: null, capture: null, timer: null, ended: false};
  own.client = new RealtimeClient({
    committed: (text) => { if (!own.ended) $("committed").textContent = text; },
    tentative: (text) => {
      if (!own.ended) $("tentative").textContent = text ? (text.startsWith(" ") ? text : " " + text) : "";
    },
    lag: (behindSeconds) => { if (!own.ended) showLag(behindSeconds); },
    done: (text, usage) => {
      if (own.ended) return;
      endSession(own);
      $("committed").textContent = text;
      $("tentative").textContent = "";
      show(own, "done", `Done (${usage ? usage.completion_tokens : 0} tokens decoded).`);
    },
    error: (message) => {  // the input is over: the server dropped it, or is closing the connection
      if (own.ended) return;
      endSession(own);
      show(own, "error", `Error: ${message}`);
    },
    closed: (reason) => {  // before the session was created, open() rejects instead
      if (own.ended) return;
      endSession(own);
      if (["streaming", "finishing"].includes(document.body.dataset.state)) {
        show(own, "error", `Connection closed: ${reason}`);
      }
    },
  });
  session = own;
  return own;
}

// nothing more is sent for `own`: the file's timer stopped, the microphone released, the socket closed
function endSession(own) {
  own.ended = true;
  clearInterval(own.timer);
  own.timer = null;
  stopCapture(own);
  own.client.close();
  if (own === session) showLag(0);
}

function showLag(behindSeconds) {  // the server's audio not yet decoded when its last result came back
  const behind = behindSeconds >= LAG_SHOWN_S;
  document.body.dataset.lag = behind ? "behind" : "";
  $("lag").hidden = !behind;
  $("lag").textContent = behind ? `catching up: ${behindSeconds.toFixed(1)} s behind` : "";
}

async function startMicrophone() {
  const own = newSession();
  let media = null;
  let worklet = null;
  try {
    await own.client.open($("api-key").value);  // first the socket, then the worklet: no captured audio waits
    worklet = await pcmWorklet({sampleRate: RATE}, own.client);  // the browser resamples the microphone to 16 kHz
    media = await navigator.mediaDevices.getUserMedia({
      audio: {channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false},
    });
    try {
      worklet.context.createMediaStreamSource(media).connect(worklet.node);
    } catch (err) {  // a browser that cannot: the worklet resamples from the device's rate
      worklet.context.close();
      worklet = await pcmWorklet({}, own.client);
      worklet.context.createMediaStreamSource(media).connect(worklet.node);
    }
    own.capture = {context: worklet.context, node: worklet.node, media};
    // the connection closed (or a newer Start ended this one) while the microphone opened: a prompt can take long
    if (own.ended) throw new Error("the connection closed before the microphone was ready");
    show(own, "streaming", "Listening...");
  } catch (err) {
    if (!own.capture) {
      if (media) media.getTracks().forEach((track) => track.stop());
      if (worklet) worklet.context.close();
    }
    endSession(own);
    show(own, "error", `Error: ${err.message}`);
  }
}

async function pcmWorklet(contextOptions, client) {  // -> {context, node}: the pcm16 worklet, its blocks sent by client
  const context = new AudioContext(contextOptions);
  try {
    await context.audioWorklet.addModule("/static/pcm-worklet.js");
    const node = new AudioWorkletNode(context, "pcm16");
    node.port.onmessage = (event) => client.append(new Int16Array(event.data));
    return {context, node};
  } catch (err) {
    context.close();
    throw err;
  }
}

function stopCapture(own) {
  if (!own.capture) return;
  own.capture.media.getTracks().forEach((track) => track.stop());
  own.capture.context.close();
  own.capture = null;
}

function stopMicrophone() {
  const own = session;
  if (!own || !own.capture) return;
  own.capture.node.port.postMessage("flush");
  setTimeout(() => {  // the flushed block arrives through the worklet's port first
    if (own.ended) return;  // an error or a close came meanwhile: the page says so already
    stopCapture(own);
    show(own, "finishing", "Finishing...");
    own.client.finish();
  }, 50);
}

async function decodeFile(file) {  // -> Int16Array of 16 kHz mono samples
  const bytes = await file.arrayBuffer();
  const decoder = new OfflineAudioContext(1, RATE, RATE);  // decodeAudioData resamples to 16 kHz
  const audio = await decoder.decodeAudioData(bytes);
  const channels = [...Array(audio.numberOfChannels).keys()].map((c) => audio.getChannelData(c));
  const out = new Int16Array(audio.length);
  for (let i = 0; i < audio.length; i++) {
    let sum = 0;
    for (const channel of channels) sum += channel[i];
    const value = Math.max(-1, Math.min(1, sum / channels.length));
    out[i] = Math.max(-32768, Math.min(32767, Math.round(value * 32768)));
  }
  return out;
}

async function streamFile() {
  const file = $("file").files[0];
  const own = newSession();
  try {
    const samples = await decodeFile(file);
    await own.client.open($("api-key").value);
    if (own.ended) throw new Error("the connection closed");  // at once, or a newer Start ended this one
    show(own, "streaming", `Streaming ${file.name} (${(samples.length / RATE).toFixed(1)} s) at real-time pace...`);
    const block = RATE * BLOCK_MS / 1000;
    let offset = 0;
    own.timer = setInterval(() => {
      if (offset < samples.length) {
        own.client.append(samples.subarray(offset, Math.min(offset + block, samples.length)));
        offset += block;
      } else {
        clearInterval(own.timer);
        own.timer = null;
        show(own, "finishing", "Finishing...");
        own.client.finish();
      }
    }, BLOCK_MS);
  } catch (err) {
    endSession(own);
    show(own, "error", `Error: ${err.message}`);
  }
}

$("mic-start").addEventListener("click", startMicrophone);
$("mic-stop").addEventListener("click", stopMicrophone);
$("file").addEventListener("change", () => setState(document.body.dataset.state));
$("file-start").addEventListener("click", streamFile);
setState("idle");
