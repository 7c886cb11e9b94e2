// llama-peer: the real llama.cpp (the prebuilt libllama of the @node-llama-cpp/linux-x64 npm
// package, driven through node-llama-cpp) as a peer engine for tests and benchmarks: loads a
// GGUF with or without mmap, evaluates a few tokens, checks the next-token distribution is
// finite, prints one JSON line and, with --hold, keeps the model loaded until SIGINT/SIGTERM.
//
//   node tools/llama-peer/llama-peer.mjs --prefix NPM_PREFIX --model FILE
//        [--mmap on|off] [--tokens N] [--threads N] [--hold]
//
// NPM_PREFIX is what `scripts/llamacpp-peer.sh --prefix` prints. Exit 0 when the model loaded
// and evaluated to finite probabilities; 1 with a message on stderr otherwise; 2 bad usage.
import path from "node:path";
import { pathToFileURL } from "node:url";
import { performance } from "node:perf_hooks";

function usage(message) {
  process.stderr.write(`llama-peer: ${message}\n`);
  process.exit(2);
}

const args = { mmap: "on", tokens: 8, threads: 1, hold: false };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; ++i) {
  const a = argv[i];
  const value = () => {
    if (i + 1 >= argv.length) usage(`${a} needs a value`);
    return argv[++i];
  };
  if (a === "--prefix") args.prefix = value();
  else if (a === "--model") args.model = value();
  else if (a === "--mmap") args.mmap = value();
  else if (a === "--tokens") args.tokens = Number(value());
  else if (a === "--threads") args.threads = Number(value());
  else if (a === "--hold") args.hold = true;
  else usage(`unknown argument ${a}`);
}
if (!args.prefix || !args.model) usage("--prefix and --model are required");
if (args.mmap !== "on" && args.mmap !== "off") usage("--mmap is on or off");
if (!Number.isInteger(args.tokens) || args.tokens < 1 || args.tokens > 256) {
  usage("--tokens is 1..256");
}
if (!Number.isInteger(args.threads) || args.threads < 1) usage("--threads is at least 1");

const fail = (message) => {
  process.stderr.write(`llama-peer: ${message}\n`);
  process.exit(1);
};

try {
  const entry = path.join(args.prefix, "node_modules", "node-llama-cpp", "dist", "index.js");
  const { getLlama, LlamaLogLevel } = await import(pathToFileURL(entry).href);
  const started = performance.now();
  // The prebuilt CPU binaries only: never build, never download, no GPU probing.
  const llama = await getLlama({
    gpu: false,
    build: "never",
    skipDownload: true,
    usePrebuiltBinaries: true,
    progressLogs: false,
    logLevel: LlamaLogLevel.error,
    maxThreads: args.threads,
  });
  const loadStart = performance.now();
  const model = await llama.loadModel({
    modelPath: args.model,
    useMmap: args.mmap === "on",
    gpuLayers: 0,
  });
  const loaded = performance.now();
  const context = await model.createContext({ contextSize: 256, threads: args.threads });
  const sequence = context.getSequence();
  // Token ids past the special tokens and below the 256 byte tokens of a gen-model vocabulary.
  const tokens = [];
  for (let i = 0; i < args.tokens; ++i) tokens.push(3 + ((i * 37) % 256));
  let probabilities = null;
  for await (const out of sequence.evaluateWithMetadata(tokens, { probabilities: true })) {
    probabilities = out.probabilities;
    break;  // the distribution after the prompt is enough
  }
  const ready = performance.now();
  if (probabilities === null || probabilities.size === 0) fail("no next-token distribution");
  let sum = 0;
  let top = -1;
  let topP = -1;
  for (const [token, p] of probabilities) {
    if (!Number.isFinite(p)) fail(`token ${token} has probability ${p}: the logits are not finite`);
    sum += p;
    if (p > topP) {
      topP = p;
      top = token;
    }
  }
  if (!(Math.abs(sum - 1) < 1e-3)) fail(`the probabilities sum to ${sum}, not 1`);
  const result = {
    engine: "llama.cpp",
    mmap: model.useMmap,
    model: args.model,
    tokens: args.tokens,
    top_token: top,
    top_probability: topP,
    probability_sum: sum,
    init_seconds: (loadStart - started) / 1000,
    load_seconds: (loaded - loadStart) / 1000,
    ready_seconds_in_process: ready / 1000,
    pid: process.pid,
  };
  process.stdout.write(JSON.stringify(result) + "\n");
  if (args.hold) {
    // Signal listeners alone do not keep node's event loop alive; the interval does.
    const keepAlive = setInterval(() => {}, 1 << 30);
    await new Promise((resolve) => {
      process.once("SIGINT", resolve);
      process.once("SIGTERM", resolve);
    });
    clearInterval(keepAlive);
  }
  await context.dispose();
  await model.dispose();
  process.exit(0);
} catch (error) {
  fail(error && error.message ? error.message : String(error));
}
