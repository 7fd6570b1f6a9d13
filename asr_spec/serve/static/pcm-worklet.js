// AudioWorklet: the capture's float samples (at the context's rate) -> 16 kHz mono PCM16, posted to the page in
// blocks of BLOCK samples (100 ms). At a 16 kHz context the samples pass through unchanged (no resampling);
// otherwise they are resampled by linear interpolation.
const TARGET_RATE = 16000;
const BLOCK = 1600;

class Pcm16Processor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / TARGET_RATE;  // input samples per output sample
    this.position = 0;  // where the next output sample falls, in input samples from the current block's start
    this.previous = 0;  // the last input sample of the previous block (interpolation across blocks)
    this.out = new Int16Array(BLOCK);
    this.n = 0;
    this.port.onmessage = (event) => { if (event.data === "flush") this.flush(); };
  }

  push(value) {
    const clamped = Math.max(-1, Math.min(1, value));
    this.out[this.n++] = Math.max(-32768, Math.min(32767, Math.round(clamped * 32768)));
    if (this.n === BLOCK) this.flush();
  }

  flush() {
    if (this.n === 0) return;
    const block = this.out.slice(0, this.n);
    this.port.postMessage(block.buffer, [block.buffer]);
    this.n = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    if (this.step === 1) {
      for (let i = 0; i < channel.length; i++) this.push(channel[i]);
      return true;
    }
    while (this.position < channel.length) {
      const i = Math.floor(this.position);
      const frac = this.position - i;
      const before = i === 0 ? this.previous : channel[i - 1];
      const after = channel[i];
      this.push(before + (after - before) * frac);
      this.position += this.step;
    }
    this.position -= channel.length;
    this.previous = channel[channel.length - 1];
    return true;
  }
}

registerProcessor("pcm16", Pcm16Processor);
