// The page: microphone capture (getUserMedia + the pcm16 AudioWorklet) or a file streamed at real-time pace,
// both through RealtimeClient; committed text and the tentative rest shown apart. body[data-state] says where a
// session is: idle, streaming, finishing, done, error (the browser test waits on it); body[data-lag] is "behind"
// while the server reports it is catching up (transcription.lag), shown as a small note beside the status.
"use strict";

const RATE = 16000;
const BLOCK_MS = 100;  // a file is sent in blocks of this much audio, one per BLOCK_MS of wall time
const LAG_SHOWN_S = 1.0;  // the server is shown as catching up from this much audio waiting (its own threshold)
const $ = (id) => document.getElementById(id);
let client = null;
let capture = null;  // {context, stream, node} while the microphone runs
let fileTimer = null;

function setState(state, status) {
  document.body.dataset.state = state;
  if (status !== undefined) $("status").textContent = status;
  const busy = state === "streaming" || state === "finishing";
  $("mic-start").disabled = busy;
  $("mic-stop").disabled = !(busy && capture);
  $("file-start").disabled = busy || !$("file").files.length;
}

function newClient() {
  $("committed").textContent = "";
  $("tentative").textContent = "";
  return new RealtimeClient({
    committed: (text) => { $("committed").textContent = text; },
    tentative: (text) => { $("tentative").textContent = text ? (text.startsWith(" ") ? text : " " + text) : ""; },
    lag: showLag,
    done: (text, usage) => {
      showLag(0);
      $("committed").textContent = text;
      $("tentative").textContent = "";
      setState("done", `Done (${usage ? usage.completion_tokens : 0} tokens decoded).`);
      client.close();
    },
    error: (message) => setState("error", `Error: ${message}`),
    closed: (reason) => {
      if (document.body.dataset.state === "streaming" || document.body.dataset.state === "finishing") {
        setState("error", `Connection closed: ${reason}`);
      }
      stopCapture();
    },
  });
}

function showLag(behindSeconds) {  // the server's audio not yet decoded when its last result came back
  const behind = behindSeconds >= LAG_SHOWN_S;
  document.body.dataset.lag = behind ? "behind" : "";
  $("lag").hidden = !behind;
  $("lag").textContent = behind ? `catching up: ${behindSeconds.toFixed(1)} s behind` : "";
}

async function startMicrophone() {
  let media = null;
  let worklet = null;
  try {
    client = newClient();
    await client.open($("api-key").value);  // first the socket, then the worklet: no captured audio waits
    worklet = await pcmWorklet({sampleRate: RATE});  // the browser resamples the microphone to 16 kHz
    media = await navigator.mediaDevices.getUserMedia({
      audio: {channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false},
    });
    try {
      worklet.context.createMediaStreamSource(media).connect(worklet.node);
    } catch (err) {  // a browser that cannot: the worklet resamples from the device's rate
      worklet.context.close();
      worklet = await pcmWorklet({});
      worklet.context.createMediaStreamSource(media).connect(worklet.node);
    }
    capture = {context: worklet.context, node: worklet.node, media};
    setState("streaming", "Listening...");
  } catch (err) {
    if (!capture) {
      if (media) media.getTracks().forEach((track) => track.stop());
      if (worklet) worklet.context.close();
    }
    stopCapture();
    if (client) client.close();
    setState("error", `Error: ${err.message}`);
  }
}

async function pcmWorklet(contextOptions) {  // -> {context, node}: the pcm16 worklet, its blocks sent
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

function stopCapture() {
  if (!capture) return;
  capture.media.getTracks().forEach((track) => track.stop());
  capture.context.close();
  capture = null;
}

function stopMicrophone() {
  if (!capture) return;
  capture.node.port.postMessage("flush");
  setTimeout(() => {  // the flushed block arrives through the worklet's port first
    stopCapture();
    setState("finishing", "Finishing...");
    client.finish();
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
  try {
    client = newClient();
    const samples = await decodeFile(file);
    await client.open($("api-key").value);
    setState("streaming", `Streaming ${file.name} (${(samples.length / RATE).toFixed(1)} s) at real-time pace...`);
    const block = RATE * BLOCK_MS / 1000;
    let offset = 0;
    fileTimer = setInterval(() => {
      if (offset < samples.length) {
        client.append(samples.subarray(offset, Math.min(offset + block, samples.length)));
        offset += block;
      } else {
        clearInterval(fileTimer);
        setState("finishing", "Finishing...");
        client.finish();
      }
    }, BLOCK_MS);
  } catch (err) {
    setState("error", `Error: ${err.message}`);
  }
}

$("mic-start").addEventListener("click", startMicrophone);
$("mic-stop").addEventListener("click", stopMicrophone);
$("file").addEventListener("change", () => setState(document.body.dataset.state));
$("file-start").addEventListener("click", streamFile);
setState("idle");
