#!/usr/bin/env python3
"""Checks every shell command the README and the book (docs/) show against the code as it is:
each program it names exists (an example, a package, a script), and each `--flag` it passes
is one that program takes — the examples', kvbench's and the server's from their `--help`
(docs/reference/help/*.txt, which tests/book.rs holds equal to the binaries), a Python
script's from its `add_argument` calls, cargo's `--example`/`-p`/`--test`/`--features` from
the workspace. Commands of other tools (curl, pip, apt-get, mkdir) are left alone.

Every command is also either run as written by `--run` (CI runs it: the quick ones, in the
order the page shows them, a server in the background until its page's commands are done),
or run by CI itself word for word (RUN_BY_CI: the test suite, the cuda build; checked to be
lines of .ci/run), or named in NOT_RUN with the reason (a benchmark of minutes to hours, four
GPUs, fixtures that need PyTorch); a new command must be one of the three. The flag tables of the examples' and
the server's chapters are checked against the binaries' flags too.

    python3 scripts/check_book_commands.py         # exit 1 listing every command that fails
    python3 scripts/check_book_commands.py --run   # and run the runnable ones, as written
"""
import glob
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP = os.path.join(ROOT, "docs", "reference", "help")
MODEL_EXAMPLES = {"llama", "gemma", "mistral", "qwen", "opt"}
OTHER_TOOLS = {"curl", "pip", "mkdir", "sudo", "apt-get", "eval", "cd", "export", "ls", "rm",
               "cat", "echo", "ulimit", "UPDATE_EXPECT=1"}


def flags_in_help(name):
    """Long flags a `--help` text lists."""
    with open(os.path.join(HELP, f"{name}.txt")) as f:
        return set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", f.read()))


def script_flags(path):
    """Long flags a Python script's argparse declares."""
    with open(path) as f:
        return set(re.findall(r"""add_argument\(\s*(?:"-[a-z]",\s*)?["'](--[a-z0-9-]+)""", f.read()))


def workspace():
    """Examples, packages (name -> their dir), integration tests and features."""
    examples = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(f"{ROOT}/examples/*.rs")}
    examples |= {os.path.basename(os.path.dirname(p)) for p in glob.glob(f"{ROOT}/examples/*/main.rs")}
    packages, features = {}, set()
    for toml in glob.glob(f"{ROOT}/Cargo.toml") + glob.glob(f"{ROOT}/crates/*/Cargo.toml") + \
            glob.glob(f"{ROOT}/examples/*/Cargo.toml"):
        text = open(toml).read()
        m = re.search(r'^\[package\][^\[]*?^name\s*=\s*"([^"]+)"', text, re.M | re.S)
        if m:
            packages[m.group(1)] = os.path.dirname(toml)
        feat = re.search(r"^\[features\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
        if feat:
            features |= set(re.findall(r"^([a-z0-9_-]+)\s*=", feat.group(1), re.M))
    tests = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(f"{ROOT}/tests/*.rs")}
    tests |= {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(f"{ROOT}/crates/*/tests/*.rs")}
    return examples, packages, tests, features


EXAMPLES, PACKAGES, TESTS, FEATURES = workspace()


def long_flags(args):
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def check_program(prog, args):
    """Problems with running `prog args` (a binary the workspace builds, or a script)."""
    base = os.path.basename(prog)
    if prog.startswith("target/release/examples/") or prog.startswith("target/cuda/release/examples/"):
        return check_example(base, args)
    if prog.startswith("target/release/"):
        return check_package(base, args)
    if prog.startswith("scripts/") and prog.endswith(".py"):
        return check_script(prog, args)
    if prog.startswith("scripts/") and prog.endswith(".sh"):
        return [] if os.path.exists(os.path.join(ROOT, prog)) else [f"no script {prog}"]
    return [f"unknown program {prog}"]


def check_example(name, args):
    if name not in EXAMPLES:
        return [f"no example {name}"]
    known = {"kvbench": "kvbench"}.get(name, "llama" if name in MODEL_EXAMPLES else None)
    if known is None:
        return []
    allowed = flags_in_help(known)
    return [f"{name} takes no {f}" for f in long_flags(args) if f not in allowed]


def check_package(name, args):
    if name not in PACKAGES:
        return [f"no package {name}"]
    if name == "kvpolicy-server":
        allowed = flags_in_help("kvpolicy-server")
        return [f"kvpolicy-server takes no {f}" for f in long_flags(args) if f not in allowed]
    return []


def check_script(path, args):
    full = os.path.join(ROOT, path)
    if not os.path.exists(full):
        return [f"no script {path}"]
    allowed = script_flags(full)
    return [f"{path} takes no {f}" for f in long_flags(args) if f not in allowed]


def check_cargo(args):
    problems, i = [], 0
    sub = args[0] if args else ""
    if sub not in {"run", "build", "test", "fetch", "install", "bench", "doc"}:
        return [f"cargo {sub}?"]
    rest = args[1:]
    tail = []
    if "--" in rest:
        tail = rest[rest.index("--") + 1:]
        rest = rest[:rest.index("--")]
    example = package = None
    while i < len(rest):
        a = rest[i]
        val = rest[i + 1] if i + 1 < len(rest) else ""
        if a == "--example":
            example = val
            if val not in EXAMPLES:
                problems.append(f"no example {val}")
        elif a == "-p":
            package = val
            if val not in PACKAGES:
                problems.append(f"no package {val}")
        elif a == "--test":
            if val not in TESTS:
                problems.append(f"no test {val}")
        elif a == "--features":
            problems += [f"no feature {f}" for f in val.split(",") if f not in FEATURES]
        i += 1
    if sub == "run":
        if example:
            problems += check_example(example, tail)
        elif package:
            problems += check_package(package, tail)
    return problems


def commands(path):
    """(line number, command text) of every shell line of `path`'s sh blocks."""
    out, fence, buf, start = [], None, "", 0
    for n, line in enumerate(open(path), 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence not in ("sh", "bash", "shell"):
            continue
        text = line.rstrip("\n")
        if not buf:
            start = n
        if text.endswith("\\"):
            buf += text[:-1] + " "
            continue
        text, buf = (buf + text).strip(), ""
        if text and not text.startswith("#"):
            out.append((start, text))
    return out


def check(text):
    try:
        words = shlex.split(text, comments=True)
    except ValueError as e:
        return [f"cannot be parsed: {e}"]
    problems, cmd = [], []
    for w in words + [";"]:
        if w in {"&&", "||", ";", "|"}:
            problems += check_one(cmd)
            cmd = []
        else:
            cmd.append(w)
    return problems


def check_one(cmd):
    while cmd and re.match(r"^[A-Z_]+=", cmd[0]):  # environment assignments
        cmd = cmd[1:]
    if not cmd:
        return []
    prog, args = cmd[0], cmd[1:]
    if prog == "cargo":
        return check_cargo(args)
    if prog == "mpirun":
        while args and args[0].startswith("-"):
            args = args[2:] if args[0] in {"-np", "-n", "--host", "-H", "-x"} else args[1:]
        return check_one(args)
    if prog in {"python3", "python", "bash"}:
        if args and args[0] == "-c":  # inline code
            return []
        return check_program(args[0], args[1:]) if args else []
    if prog.startswith("target/") or prog.startswith("scripts/"):
        return check_program(prog, args)
    if prog in OTHER_TOOLS or prog.startswith("-"):
        return []
    return [f"unknown program {prog}"]


# Commands not run by --run, each with the reason (matched by how the command starts).
NOT_RUN = {
    "cargo run --release --example kvbench": "a benchmark sweep: minutes to an hour",
    "python3 scripts/quality.py": "the quality benchmark: an hour",
    "python3 scripts/link_bound.py": "a benchmark: tens of minutes",
    "python3 scripts/long_context_bench.py": "a benchmark: an hour",
    "cargo build --release --examples": "the build a benchmark below needs (the tests build every example)",
    "pip install": "the fixture generators' Python packages (PyTorch: gigabytes)",
    "CMAKE_ARGS=-DGGML_NATIVE=OFF pip install": "llama.cpp from source for the fixture generators",
    "python3 scripts/make_": "regenerates committed fixtures (needs PyTorch, transformers, llama.cpp)",
    "cargo build --release                       # also builds": "a workspace build for kvpolicy-compress, whose calibration takes minutes",
    "target/release/kvpolicy-compress": "a calibration over the model: minutes (tests/compress*.rs run it on fixtures)",
    "cargo run --release --example llama -- --model-dir smollm2-kv1": "needs the model the calibration above writes",
    "mpirun -np 4 -x LD_LIBRARY_PATH": "four GPUs",
}
# Commands CI runs itself, word for word (each must appear so in .ci/run): the test suite,
# and the cuda build's (it needs the CUDA toolchain set up in the same shell).
RUN_BY_CI = ["bash scripts/test.sh", "cargo fetch", "eval \"$(bash scripts/cuda-toolchain.sh)\"",
             "cargo build --release --features nccl --examples",
             "cargo test --release --features nccl --test cuda --no-run"]
SERVER = "cargo run --release -p kvpolicy-server"
# Files the runnable commands write in the working directory, removed after the run.
WRITTEN = ["stats.json", "chat.kvs", "doc-and-q1.txt", "doc-and-q2.txt"]


def without_comment(text):
    """The command without a trailing `# comment`."""
    return re.sub(r"\s+#\s.*$", "", text).strip()


def by_ci(text):
    """Whether CI runs `text` itself (RUN_BY_CI)."""
    return without_comment(text) in RUN_BY_CI


def not_run(text):
    if by_ci(text):
        return "CI runs it word for word"
    return next((why for start, why in NOT_RUN.items() if text.startswith(start)), None)


def check_ci_runs():
    """Each RUN_BY_CI command is a line of .ci/run, word for word (its output may be
    redirected or piped)."""
    lines = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run"))]

    def runs(c):
        return any(line == c or re.match(re.escape(c) + r" +(2>&1|\||>)", line) for line in lines)
    return [f".ci/run does not run `{c}` word for word (RUN_BY_CI says it does)"
            for c in RUN_BY_CI if not runs(c)]


def wait_for_server(proc, port=8080, limit_s=300):
    import time
    import urllib.request
    start = time.time()
    while time.time() - start < limit_s:
        if proc.poll() is not None:
            return f"the server exited with status {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(1)
    return f"the server did not answer /health within {limit_s} s"


def run_all(files):
    """Runs every command not in NOT_RUN, as written, from the repository's root."""
    import signal
    import subprocess
    import time
    env = dict(os.environ)
    if os.geteuid() == 0:  # Open MPI refuses root unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    failed = []
    try:
        for f in files:
            server = None
            for n, text in commands(f):
                if not_run(text):
                    continue
                where = f"{os.path.relpath(f, ROOT)}:{n}"
                t0 = time.time()
                if text.startswith(SERVER):
                    server = subprocess.Popen(["bash", "-c", f"exec {text}"], cwd=ROOT, env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                              start_new_session=True)
                    problem = wait_for_server(server)
                else:
                    proc = subprocess.run(["bash", "-c", text], cwd=ROOT, env=env, timeout=600,
                                          capture_output=True, text=True)
                    problem = None if proc.returncode == 0 else \
                        f"exit status {proc.returncode}: {proc.stderr.strip()[-300:]}"
                print(f"{'ok  ' if problem is None else 'FAIL'} {time.time() - t0:6.1f} s  {where}: {text[:110]}", flush=True)
                if problem:
                    failed.append(f"{where}: {problem}\n    {text[:160]}")
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=60)
    finally:
        for name in WRITTEN:
            path = os.path.join(ROOT, name)
            if os.path.exists(path):
                os.remove(path)
    return failed


# The chapters whose flag tables describe a binary's flags (prose beside the generated
# reference): every flag in a table row's first cell must be one the binary takes.
FLAG_TABLES = {"docs/examples.md": ("llama", "kvbench"), "docs/serving.md": ("kvpolicy-server",)}


def check_flag_tables():
    problems = []
    for page, binaries in FLAG_TABLES.items():
        allowed = set().union(*(flags_in_help(b) for b in binaries))
        for n, line in enumerate(open(os.path.join(ROOT, page)), 1):
            if not line.startswith("| `--"):
                continue
            first = line.split("|")[1]
            problems += [f"{page}:{n}: the table names {f}, which {'/'.join(binaries)} do not take"
                         for f in re.findall(r"(--[a-z0-9][a-z0-9-]*)", first) if f not in allowed]
    return problems


def main():
    run = "--run" in sys.argv[1:]
    files = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(f"{ROOT}/docs/**/*.md", recursive=True))
    failed, checked = [], 0
    for f in files:
        for n, text in commands(f):
            checked += 1
            for p in check(text):
                failed.append(f"{os.path.relpath(f, ROOT)}:{n}: {p}\n    {text[:160]}")
    failed += check_flag_tables()
    failed += check_ci_runs()
    all_commands = [t for f in files for _, t in commands(f)]
    ran = sum(1 for t in all_commands if not not_run(t))
    ci = sum(1 for t in all_commands if by_ci(t))
    print(f"{checked} commands checked, {len(failed)} problems; {ran} run by --run, {ci} by CI "
          f"itself, {checked - ran - ci} not (NOT_RUN gives each one's reason)")
    if run and not failed:
        failed = run_all(files)
    for line in failed:
        print(line)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
