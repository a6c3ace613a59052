//! `echo-child`: the physical floor of `bench_walredo`, a child that speaks the walredo framing
//! but does no work.
//!
//! It reads frames from stdin exactly like `walredo-proc` (one `read` into a 256 KiB buffer,
//! then every complete frame in it) and answers each `G` (end of a redo request) and each `H`
//! (ping) with one write of a page frame: `p`, length 8196, 8192 zero bytes. It does not check
//! tags, records or order, sends no hello, and installs no sandbox: what remains is the cost of
//! the pipes, the wake-ups and the copies, which no manager can go below.
//!
//! Std only, so that it starts fast and measures nothing but the I/O. Exits 0 on EOF and 2 on a
//! frame length it cannot parse.
//!
//! Trust model: the bench is its only peer and is trusted; a malformed frame ends the process.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::process::ExitCode;

use walredo_proc::page::BLCKSZ;
use walredo_proc::protocol::{HEADER_LEN, MAX_FRAME_LEN};

const READ_BUF_LEN: usize = 256 * 1024;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("echo-child: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<(), String> {
    // Own duplicates of fds 0 and 1, so that reads and writes bypass std's buffering.
    let dup = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().map(std::fs::File::from);
    let mut input = dup(std::io::stdin().as_fd()).map_err(|e| format!("dup stdin: {e}"))?;
    let mut output = dup(std::io::stdout().as_fd()).map_err(|e| format!("dup stdout: {e}"))?;

    let mut reply = vec![0u8; HEADER_LEN + BLCKSZ];
    reply[0] = b'p';
    reply[1..HEADER_LEN].copy_from_slice(&((4 + BLCKSZ) as u32).to_be_bytes());

    let mut buf = vec![0u8; READ_BUF_LEN];
    let mut filled = 0;
    loop {
        let n = match input.read(&mut buf[filled..]) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("read stdin: {e}")),
        };
        if n == 0 {
            return if filled == 0 { Ok(()) } else { Err(format!("EOF inside a frame ({filled} bytes)")) };
        }
        filled += n;

        let mut start = 0;
        while let Some(header) = buf.get(start..start + HEADER_LEN).filter(|_| start + HEADER_LEN <= filled) {
            let tag = header[0];
            let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
            if !(4..=MAX_FRAME_LEN).contains(&len) {
                return Err(format!("bad frame length {len}"));
            }
            let end = start + 1 + len;
            if end > filled {
                break;
            }
            if tag == b'G' || tag == b'H' {
                output.write_all(&reply).map_err(|e| format!("write stdout: {e}"))?;
            }
            start = end;
        }
        buf.copy_within(start..filled, 0);
        filled -= start;
    }
}
