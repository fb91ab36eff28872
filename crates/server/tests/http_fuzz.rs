//! The HTTP fuzz target's smoke run inside `cargo test`: its seeds (`fuzz/seeds/http/`:
//! hand-made requests, and any input a `cargo fuzz run http` found) and random mutations — bytes flipped,
//! cut, repeated, and HTTP and JSON words spliced in — go through the same body as the
//! fuzzer ([`kvpolicy_server::fuzzing::http`]), which panics on a 5xx, a hang or leaked
//! internals. `KVPOLICY_HTTP_FUZZ_SECS` sets the time for mutations (default 10).
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use kvpolicy_server::fuzzing;

/// Words a mutation splices in: what the request line, headers and JSON are made of.
const WORDS: &[&str] = &[
    "\r\n",
    "\r\n\r\n",
    "Content-Length: 99999999\r\n",
    "Content-Length: -1\r\n",
    "Transfer-Encoding: chunked\r\n",
    "Expect: 100-continue\r\n",
    "Host: evil.example\r\n",
    "Origin: null\r\n",
    "Authorization: Bearer \r\n",
    "Connection: close\r\n",
    "POST /v1/chat/completions HTTP/1.1\r\n",
    "GET /health HTTP/1.1\r\n",
    "\"max_tokens\": 100000",
    "\"n\": 16",
    "\"temperature\": 1e-320",
    "\"top_p\": 5e-324",
    "\"logit_bias\": {\"0\": 100}",
    "\"stop\": [\"\"]",
    "\"prompt\": [4294967295]",
    "\"stream\": true",
    "\"messages\": [{\"role\": \"tool\"}]",
    "<|im_start|>",
    "\\ud800",
    "null",
    "{",
    "[",
    "\u{0}",
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(5) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.truncate(at),
            2 => {
                let w = WORDS[rng.below(WORDS.len())].as_bytes();
                v.splice(at..at, w.iter().copied());
            }
            3 if at < v.len() => {
                let end = (at + 1 + rng.below(16)).min(v.len());
                let piece = v[at..end].to_vec();
                v.splice(at..at, piece);
            }
            _ => v.insert(at.min(v.len()), rng.next() as u8),
        }
    }
    v
}

fn corpus() -> Result<Vec<Vec<u8>>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/http");
    let mut seeds = Vec::new();
    for e in std::fs::read_dir(&dir)? {
        seeds.push(std::fs::read(e?.path())?);
    }
    ensure!(
        seeds.len() >= 10,
        "{} holds {} inputs",
        dir.display(),
        seeds.len()
    );
    Ok(seeds)
}

#[test]
fn the_router_survives_its_corpus_and_mutations() -> Result<()> {
    let seeds = corpus()?;
    let secs: u64 = std::env::var("KVPOLICY_HTTP_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let budget = Duration::from_secs(secs);
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let start = Instant::now();
    let mut runs = 0usize;
    let mut run = |input: &[u8]| {
        let r = std::panic::catch_unwind(|| fuzzing::http(input));
        assert!(
            r.is_ok(),
            "panicked on input {:?}",
            String::from_utf8_lossy(input)
        );
        runs += 1;
    };
    for s in &seeds {
        run(s);
    }
    while start.elapsed() < budget {
        let s = &seeds[rng.below(seeds.len())];
        run(&mutate(s, &mut rng));
    }
    println!(
        "http: {runs} inputs in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
