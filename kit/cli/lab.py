"""`python -m kit lab [--ip IP] [--port N] [--no-browser] [--fresh [CHAPTER ...]] [--work DIR]`:
JupyterLab on the participant's own copies of the chapters (`kit.cli.working_copies`: made in
runs/lab/ on the first start, kept as they were saved on every later one), with the kit's
environment as the kernel. It checks the address before starting, works as root, prints the
address to open (with its token, and how to reach it from another machine) and where the copies
are, and keeps JupyterLab's "get notified about news?" pop-up off. Jupyter is imported by the
child process, not by the CLI."""
from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from pathlib import Path

from kit.cli.working_copies import WORK_DIR, make_copies, where_your_work_is
from kit.errors import ConfigError
from kit.execute.notebooks import kernel_env
# JupyterLab's settings for its news and update checks, as an environment-wide override (a file
# of its own under overrides.d, beside any overrides.json of the user's).
NEWS_OFF = {"@jupyterlab/apputils-extension:notification":
            {"fetchNews": "false", "checkForUpdates": False}}
LOCAL = ("127.0.0.1", "localhost", "::1")


def add_cli(sub) -> None:
    p = sub.add_parser("lab", help="JupyterLab on the chapters (prints the address to open)")
    p.add_argument("--ip", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8888, help="port (default 8888)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser here")
    p.add_argument("--fresh", nargs="*", metavar="CHAPTER",
                   help="start over: copy these chapters (all when none is named) from "
                        "notebooks/ again, setting your copies aside")
    p.add_argument("--work", type=Path, default=WORK_DIR, metavar="DIR",
                   help=f"the folder of your copies (default {WORK_DIR})")
    p.set_defaults(func=lab)


def check_address(ip: str, port: int) -> None:
    """Refuses, before JupyterLab starts, a port out of range or an address it cannot listen on."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a port from 1 to 65535")
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {ip}:{port} ({e.strerror}); "
                              f"give another --port or --ip") from None


def quiet_news(prefix: str = sys.prefix) -> Path:
    """Writes NEWS_OFF where JupyterLab reads this environment's overrides; returns the file."""
    settings = Path(prefix) / "share" / "jupyter" / "lab" / "settings"
    path = settings / "overrides.d" / "llm-serving-kit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(NEWS_OFF, indent=1) + "\n")
    return path


def addresses(ip: str, port: int, token: str) -> list[str]:
    """The addresses to open: the one given, or this machine's names when listening on all."""
    hosts = [ip]
    if ip in ("0.0.0.0", "::", ""):
        name = socket.gethostname()
        try:
            found = {a[4][0] for a in socket.getaddrinfo(name, None, socket.AF_INET)}
        except OSError:
            found = set()
        hosts = [name, *sorted(found - {"127.0.0.1"}), "127.0.0.1"]
    return [f"http://{'[' + h + ']' if ':' in h else h}:{port}/lab?token={token}" for h in hosts]


def lab_command(ip: str, port: int, token: str, open_browser: bool,
                root: Path = WORK_DIR) -> list[str]:
    """JupyterLab's command line, serving `root` (the working copies): a notebook is saved
    there as it is, outputs included."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ip={ip}", f"--port={port}",
           "--port-retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}",
           "--ServerApp.log_level=WARN", "--LabApp.log_level=WARN"]  # the address is printed here
    if not open_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # a container's or a cloud machine's only user
    return cmd


def lab(args) -> int:
    check_address(args.ip, args.port)
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    quiet_news()
    copies = make_copies(args.work.resolve(), args.fresh)
    print(f"JupyterLab on {copies.folder} (kernel: {sys.executable}). Open:")
    for url in addresses(args.ip, args.port, token):
        print(f"  {url}")
    if args.ip in LOCAL:
        print(f"From another machine: ssh -L {args.port}:localhost:{args.port} <this machine>, "
              f"then open the first address there (or start with --ip 0.0.0.0).")
    print(*where_your_work_is(copies), sep="\n")
    print("Start with 00_setup_check (Run → Run All Cells). Ctrl-C twice stops JupyterLab.",
          flush=True)
    # JupyterLab takes this process's place: Ctrl-C and signals reach it directly. Its kernels
    # import this checkout's kit, wherever the copies are.
    os.execve(sys.executable, lab_command(args.ip, args.port, token, not args.no_browser,
                                          copies.folder), kernel_env())
