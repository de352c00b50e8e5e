// Runs the JavaScript reference tokenizer (transformers.js, as forked by
// @lenml/tokenizers) over committed texts; see gen_tokenizer_reference.sh,
// which fetches the library and calls this. Two modes:
//
//   node gen_tokenizer_reference.mjs gen LIB_MAIN_JS DATA_DIR TEXTS_JSONL OUT_DIR
//     For each tokenizer (llama3, qwen3, and gpt2: GPT-2's encoder.json +
//     vocab.bpe written as the tokenizer.json Hugging Face ships for GPT-2, see
//     gpt2TokenizerJson) writes OUT_DIR/<name>.jsonl: one line per text of
//     TEXTS_JSONL, {"name", "ids", "ids_ordinary"}:
//       ids           tok.encode(text, {add_special_tokens: false}) -- added
//                     tokens written in the text become their ids
//                     (Tokenizer::EncodeWithAddedTokens in C++);
//       ids_ordinary  the same with transformers.js's added-token splitter
//                     turned off: all text is ordinary text (Tokenizer::Encode).
//
//   node gen_tokenizer_reference.mjs bench LIB_MAIN_JS TOKENIZER_DIR FILE...
//     Encodes the files' contents (one encode call per file) and prints
//     "tokens=N seconds=S tokens_per_second=R" (one thread, after a warm-up
//     pass over the first file).
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const [mode, libMain, ...rest] = process.argv.slice(2);
const { TokenizerLoader } = require(path.resolve(libMain));

// GPT-2's files as a tokenizer.json (what Hugging Face's openai-community/gpt2
// ships, minus offsets-only fields). tokenizer_json_test.cc builds the same.
function gpt2TokenizerJson(dir) {
  const vocab = JSON.parse(fs.readFileSync(path.join(dir, "encoder.json"), "utf8"));
  const merges = fs.readFileSync(path.join(dir, "vocab.bpe"), "utf8").split("\n")
    .filter((l, i) => l.length > 0 && !(i === 0 && l.startsWith("#version")));
  return {
    version: "1.0",
    added_tokens: [{ id: 50256, content: "<|endoftext|>", single_word: false, lstrip: false, rstrip: false,
                     normalized: true, special: true }],
    normalizer: null,
    pre_tokenizer: { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true },
    post_processor: { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
    decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: "", end_of_word_suffix: "",
             fuse_unk: false, byte_fallback: false, vocab, merges },
  };
}

function load(dir) {
  if (fs.existsSync(path.join(dir, "encoder.json"))) {
    return TokenizerLoader.fromPreTrained({ tokenizerJSON: gpt2TokenizerJson(dir), tokenizerConfig: {} });
  }
  const tokenizerJSON = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
  const configPath = path.join(dir, "tokenizer_config.json");
  const tokenizerConfig = fs.existsSync(configPath) ? JSON.parse(fs.readFileSync(configPath, "utf8")) : {};
  return TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
}

// The same tokenizer with added tokens never split out of text.
function ordinary(dir) {
  const tok = load(dir);
  tok.added_tokens_splitter = { split: (text) => [text] };
  tok.added_tokens_map = new Map();
  return tok;
}

if (mode === "gen") {
  const [dataDir, textsPath, outDir] = rest;
  const texts = fs.readFileSync(textsPath, "utf8").split("\n").filter((l) => l.length > 0).map((l) => JSON.parse(l));
  for (const name of ["llama3", "qwen3", "gpt2"]) {
    const dir = path.join(dataDir, name);
    const tok = load(dir), plain = ordinary(dir);
    const lines = texts.map((t) => JSON.stringify({
      name: t.name,
      ids: tok.encode(t.text, { add_special_tokens: false }),
      ids_ordinary: plain.encode(t.text, { add_special_tokens: false }),
    }));
    fs.writeFileSync(path.join(outDir, `${name}.jsonl`), lines.join("\n") + "\n");
    console.error(`gen_tokenizer_reference: ${lines.length} texts -> ${path.join(outDir, name + ".jsonl")}`);
  }
} else if (mode === "bench") {
  const [dir, ...files] = rest;
  const tok = ordinary(dir);
  const texts = files.map((f) => fs.readFileSync(f, "utf8"));
  tok.encode(texts[0], { add_special_tokens: false });  // warm-up (JIT)
  const start = process.hrtime.bigint();
  let tokens = 0;
  for (const text of texts) tokens += tok.encode(text, { add_special_tokens: false }).length;
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  console.log(`tokens=${tokens} seconds=${seconds.toFixed(3)} tokens_per_second=${(tokens / seconds).toFixed(0)}`);
} else {
  console.error("usage: gen_tokenizer_reference.mjs gen|bench LIB_MAIN_JS ...");
  process.exit(2);
}
