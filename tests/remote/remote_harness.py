"""The real-parts remote harness: an OpenSSH sshd on 127.0.0.1, an unprivileged user, a `pct` stand-in.

Used by tests/remote/conftest.py (one harness per pytest session) and by bench/remote_*.py.
`start_harness()` needs root (it creates the user, a sudoers rule and the privilege-separation
directory) and installs openssh-server/sudo with apt-get only when they are missing.

What it builds under `root` (a fresh temp dir, 0755 so the test user can read its files):

    ssh_host_ed25519_key      throwaway host key;  client_key: the authorized client key
    known_hosts               `[127.0.0.1]:<port>` -> host key (what the client checks against)
    sshd_config               loopback only, key auth only; SetEnv PATH=<stand-in dir>:... and
                              DFO_PCT_STATE=<root>/pct (which containers this session's pct sees)
    pct/<ctid>/               container state (see pct_standin.py)

Shared between sessions: the stand-in itself in /usr/local/lib/dflashops-test/ (pct, ct_init.py) and
the test user; and for the provision tests (provision_host.py) the same stand-in with pveam/pvesm in
`dflashops-test/provision-<content hash>/`, reached by a second user (dfoprov) whose sudo rules name that folder.
Per session: a sudoers file (NOPASSWD for the test user on that pct only, DFO_PCT_STATE
kept through sudo). `stop()` kills only what it started: sshd by PID and each container's init by its
recorded PID; it removes its sudoers file. Concurrent sessions (two engineers' test runs) do not collide.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST_USER = "dfotest"
STANDIN_FILES = (("pct_standin.py", "pct"), ("ct_init.py", "ct_init.py"))
STANDIN_TOOLS = ("pct", "pveam", "pvesm")  # one program: it acts as the tool it is called as
STANDIN_DIR = Path("/usr/local/lib/dflashops-test")  # shared by concurrent sessions (same content)
# The provision tests' stand-in (it grows verbs) lives in a folder per content and is reached by a user of its own,
# whose sudo `secure_path` names that folder: `Defaults:dfotest secure_path` is one value for every session's
# sudoers file, so it must stay the shared folder, and a session of another branch must never replace (or be sent
# to) a stand-in of other content.
SUDOERS_DIR = Path("/etc/sudoers.d")
PROVISION_USER = "dfoprov"
PROVISION_STANDIN_DIR = STANDIN_DIR / (
    "provision-"
    + hashlib.sha256(b"".join((HERE / source).read_bytes() for source, _ in STANDIN_FILES)).hexdigest()[:12]
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_system_packages() -> None:
    """apt-get install openssh-server/sudo only when missing (a warm machine skips apt entirely)."""
    missing = [
        pkg
        for pkg, path in (("openssh-server", "/usr/sbin/sshd"), ("sudo", "/usr/bin/sudo"))
        if not Path(path).exists()
    ]
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env, stdout=subprocess.DEVNULL)


def ensure_test_user(user: str = TEST_USER) -> None:
    if subprocess.run(["id", "-u", user], capture_output=True).returncode != 0:
        added = subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", user], capture_output=True)
        # Two xdist workers start their harnesses at once on a fresh machine: the loser's useradd fails with
        # "already exists" (exit 9), and the user it wanted is there.
        if added.returncode != 0 and subprocess.run(["id", "-u", user], capture_output=True).returncode != 0:
            raise RuntimeError(f"useradd {user} failed: {added.stderr.decode(errors='replace').strip()}")
    # '!' (locked) makes sshd refuse even key logins when UsePAM is off; '*' means "no password".
    subprocess.run(["usermod", "-p", "*", user], check=True)


@dataclass
class Harness:
    root: Path
    port: int
    user: str = TEST_USER
    host: str = "127.0.0.1"
    sshd: subprocess.Popen | None = None
    started_containers: list[str] = field(default_factory=list)

    @property
    def client_key(self) -> Path:
        return self.root / "client_key"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def pct_state(self) -> Path:
        return self.root / "pct"

    @property
    def sudoers_file(self) -> Path:
        # One rule file per session (sudo skips names with '.'), so one session's teardown keeps the others'.
        return SUDOERS_DIR / ("dflashops-test-" + self.root.name.replace(".", "_"))

    @property
    def standin_env(self) -> dict[str, str]:
        return {**os.environ, "DFO_PCT_STATE": str(self.pct_state)}

    def known_hosts_line(self, port: int, host: str = "127.0.0.1") -> str:
        key_type, key_b64 = (self.root / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        name = host if port == 22 else f"[{host}]:{port}"
        return f"{name} {key_type} {key_b64}\n"

    def trust_port(self, port: int) -> None:
        """Add the host key under another port (a proxy in front of sshd is another known_hosts name)."""
        with self.known_hosts.open("a") as handle:
            handle.write(self.known_hosts_line(port))

    # -- containers ---------------------------------------------------------------------------------
    def pct(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run the stand-in directly as root (set-up and assertions; tests of the product go via ssh)."""
        return subprocess.run(
            [str(PROVISION_STANDIN_DIR / "pct"), *args],  # the same program with every verb (create, config, ...)
            capture_output=True,
            text=True,
            check=check,
            env=self.standin_env,
        )

    def create_container(self, ctid: str, hostname: str, running: bool = True) -> None:
        directory = self.pct_state / ctid
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{ctid}.conf").write_text(f"arch: amd64\nhostname: {hostname}\n")
        if running and "running" not in self.pct("status", ctid).stdout.split()[-1:]:
            self.pct("start", ctid)
            self.started_containers.append(ctid)

    def in_container(self, ctid: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.pct("exec", ctid, "--keep-env", "0", "--", *argv, check=check)

    def container_path(self, ctid: str, path: str) -> Path:
        """Host-side path of a file under /workspace in the container (for assertions only)."""
        assert path.startswith("/workspace/") or path == "/workspace"
        return self.pct_state / ctid / "workspace" / path[len("/workspace/") :]

    # -- lifecycle ----------------------------------------------------------------------------------
    def stop(self) -> None:
        for conf in self.pct_state.glob("*/*.conf"):
            if "running" in self.pct("status", conf.stem, check=False).stdout:
                self.pct("stop", conf.stem, check=False)
        if self.sshd and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(5)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
        self.sudoers_file.unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def install_standin() -> None:
    """Copy the stand-in and its init to STANDIN_DIR atomically (a concurrent session may be using them)."""
    for folder in (STANDIN_DIR, PROVISION_STANDIN_DIR):
        folder.mkdir(parents=True, exist_ok=True)
        for source, name in STANDIN_FILES:
            tmp = folder / f".{name}.{os.getpid()}"
            shutil.copy(HERE / source, tmp)
            tmp.chmod(0o755)
            os.replace(tmp, folder / name)
    for tool in STANDIN_TOOLS[1:]:  # pveam and pvesm: the same program under their names
        tmp = PROVISION_STANDIN_DIR / f".{tool}.{os.getpid()}"
        shutil.copy(PROVISION_STANDIN_DIR / "pct", tmp)
        os.replace(tmp, PROVISION_STANDIN_DIR / tool)


def _write_sshd_config(
    root: Path, port: int, folder: Path, max_sessions: int, user: str = TEST_USER, tools: Path = STANDIN_DIR
) -> Path:
    config = folder / "sshd_config"
    config.write_text(
        f"""Port {port}
ListenAddress 127.0.0.1
HostKey {root}/ssh_host_ed25519_key
PidFile {folder}/sshd.pid
AuthorizedKeysFile {root}/authorized_keys
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin no
AllowUsers {user}
AllowTcpForwarding yes
X11Forwarding no
PrintMotd no
LogLevel ERROR
MaxSessions {max_sessions}
MaxStartups 64:30:128
SetEnv PATH={tools}:/usr/local/bin:/usr/bin:/bin DFO_PCT_STATE={root}/pct
"""
    )
    return config


def start_harness() -> Harness:
    if os.geteuid() != 0:
        raise RuntimeError("the remote harness needs root (user, sudoers rule, sshd)")
    ensure_system_packages()
    ensure_test_user()
    root = Path(tempfile.mkdtemp(prefix="dfo-remote-"))
    root.chmod(0o755)
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
    subprocess.run([*keygen, "-f", str(root / "ssh_host_ed25519_key")], check=True)
    subprocess.run([*keygen, "-f", str(root / "client_key")], check=True)
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    (root / "authorized_keys").chmod(0o644)
    install_standin()
    (root / "pct").mkdir()
    Path("/workspace").mkdir(exist_ok=True)  # mount point for the containers' private workspaces
    port = free_port()
    harness = Harness(root=root, port=port)
    harness.sudoers_file.write_text(
        f'Defaults:{TEST_USER} secure_path="{STANDIN_DIR}:/usr/sbin:/usr/bin:/sbin:/bin"\n'
        f'Defaults:{TEST_USER} env_keep += "DFO_PCT_STATE"\n'
        f"{TEST_USER} ALL=(root) NOPASSWD: {STANDIN_DIR}/pct\n"
    )
    harness.sudoers_file.chmod(0o440)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    (root / "known_hosts").write_text(harness.known_hosts_line(port))
    try:
        harness.sshd = start_sshd(root, port)
    except RuntimeError:
        harness.stop()
        raise
    return harness


def start_sshd(
    root: Path,
    port: int,
    folder: Path | None = None,
    max_sessions: int = 64,
    wrapper: tuple[str, ...] = (),
    user: str = TEST_USER,
    tools: Path = STANDIN_DIR,
) -> subprocess.Popen:
    """An sshd of the harness in `root` (its host key, user and authorized keys) on `port`, with its config,
    pid file and log (-e: stderr) in `folder` (default: root), once it accepts connections. A test may start a
    second one with other limits (max_sessions: sessions per connection, OpenSSH's default is 10), or inside a
    `wrapper` that execs its arguments after setting the stage (a mount namespace with a fake GPU host's files)."""
    folder = root if folder is None else folder
    config = _write_sshd_config(root, port, folder, max_sessions, user, tools)
    with open(folder / "sshd.log", "wb") as log:  # the child keeps its own copy of the descriptor
        sshd = subprocess.Popen(
            [*wrapper, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL, stderr=log
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return sshd
        except OSError:
            if sshd.poll() is not None:
                break
            time.sleep(0.05)
    if sshd.poll() is None:
        sshd.kill()  # our own child, by its handle
        sshd.wait()
    raise RuntimeError(f"sshd did not start: {(folder / 'sshd.log').read_text(errors='replace')}")
