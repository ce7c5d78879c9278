//! The rendezvous of a torchrun-style launch: rank 0 hands one small byte string (the NCCL unique id) to
//! every other rank over TCP at `MASTER_ADDR`, before any collective exists. An `mpirun` launch needs none
//! of this: its ids travel over MPI.
//!
//! Rank 0 listens on the port, each other rank connects (retrying until rank 0 is up), says who it is,
//! and receives the payload. Every wait is bounded: a rank that never comes is an error naming it, not a
//! hang. Under torchrun's own agent (`TORCHELASTIC_USE_AGENT_STORE=True`) the agent's c10d store already
//! holds `MASTER_PORT`, so the rendezvous takes the port above it ([`port_for`]).
//!
//! Wire format (all integers little-endian): the client sends [`MAGIC`], its rank and the world size
//! (u32 each); rank 0 answers with the payload's length (u32) and the payload.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::distributed::DistributedError;

/// The first bytes of every request, so that a stray connection is told apart from a rank.
pub const MAGIC: &[u8; 12] = b"askgui-rdzv1";

/// The largest payload accepted (an NCCL id is 128 bytes).
const MAX_PAYLOAD: u32 = 1 << 16;

/// How long one connection may take to say who it is.
const HANDSHAKE: Duration = Duration::from_secs(10);

type Result<T> = std::result::Result<T, DistributedError>;

fn error(detail: impl Into<String>) -> DistributedError {
    DistributedError::Rendezvous(detail.into())
}

/// The rendezvous port for `MASTER_PORT` `master_port`: the port itself, or the next one when torchrun's
/// agent serves its store there (`agent_store`, from `TORCHELASTIC_USE_AGENT_STORE`).
pub fn port_for(master_port: u16, agent_store: bool) -> Result<u16> {
    if !agent_store {
        return Ok(master_port);
    }
    master_port.checked_add(1).ok_or_else(|| error("MASTER_PORT=65535 leaves no port above it for the rendezvous"))
}

/// Rank 0: serves `payload` to the `size - 1` other ranks on `port` (every interface), and returns once all
/// of them have it, or with an error naming the ranks that did not come within `timeout`.
pub fn serve(port: u16, size: usize, payload: &[u8], timeout: Duration) -> Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| error(format!("rank 0 could not listen on port {port} ({e}): choose a free MASTER_PORT")))?;
    serve_on(listener, size, payload, timeout)
}

/// [`serve`] on a listener that is already bound (tests bind port 0).
pub fn serve_on(listener: TcpListener, size: usize, payload: &[u8], timeout: Duration) -> Result<()> {
    let len =
        u32::try_from(payload.len()).ok().filter(|&n| n <= MAX_PAYLOAD).ok_or_else(|| error("payload too large"))?;
    listener.set_nonblocking(true).map_err(|e| error(format!("listener: {e}")))?;
    let deadline = Instant::now() + timeout;
    let mut served = BTreeSet::new();
    while served.len() + 1 < size {
        let (mut stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..size).filter(|r| !served.contains(r)).collect();
                    return Err(error(format!(
                        "rank 0 waited {timeout:?} on port {}, and ranks {missing:?} of {size} never connected: \
                         check that every rank was started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE",
                        listener.local_addr().map_or(0, |a| a.port())
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(error(format!("accept: {e}"))),
        };
        let rank = match handshake(&mut stream, size) {
            Ok(rank) => rank,
            Err(HandshakeError::Stray(why)) => {
                tracing::warn!(%peer, "rendezvous: ignored a connection that is not an askgui rank ({why})");
                continue;
            }
            Err(HandshakeError::Fatal(e)) => return Err(e),
        };
        if !served.insert(rank) {
            return Err(error(format!("two processes both say they are rank {rank}: check each rank's RANK")));
        }
        let mut reply = len.to_le_bytes().to_vec();
        reply.extend_from_slice(payload);
        stream.write_all(&reply).map_err(|e| error(format!("sending to rank {rank} ({peer}): {e}")))?;
    }
    Ok(())
}

enum HandshakeError {
    /// Not one of ours (a port scanner, a health check): ignored.
    Stray(String),
    /// One of ours, but wrong: the launch is inconsistent.
    Fatal(DistributedError),
}

/// Reads a client's request; returns its rank.
fn handshake(stream: &mut TcpStream, size: usize) -> std::result::Result<usize, HandshakeError> {
    let stray = |e: std::io::Error| HandshakeError::Stray(e.to_string());
    stream.set_nonblocking(false).map_err(stray)?;
    stream.set_read_timeout(Some(HANDSHAKE)).map_err(stray)?;
    let mut request = [0u8; 20];
    stream.read_exact(&mut request).map_err(stray)?;
    if &request[..12] != MAGIC {
        return Err(HandshakeError::Stray("wrong magic".into()));
    }
    let rank = u32::from_le_bytes(request[12..16].try_into().expect("4 bytes")) as usize;
    let their_size = u32::from_le_bytes(request[16..20].try_into().expect("4 bytes")) as usize;
    if their_size != size {
        return Err(HandshakeError::Fatal(error(format!(
            "rank {rank} was started with WORLD_SIZE={their_size}, rank 0 with WORLD_SIZE={size}"
        ))));
    }
    if rank == 0 || rank >= size {
        return Err(HandshakeError::Fatal(error(format!("a process says it is rank {rank} of {size}"))));
    }
    Ok(rank)
}

/// Rank `rank` > 0: fetches rank 0's payload from `addr:port`, retrying the connection until rank 0
/// listens, for at most `timeout`.
pub fn fetch(addr: &str, port: u16, rank: usize, size: usize, timeout: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let target = format!("{addr}:{port}");
    let mut last = String::from("no attempt");
    while Instant::now() < deadline {
        match resolve(&target).and_then(|a| connect(a, rank, size, deadline)) {
            Ok(payload) => return Ok(payload),
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(error(format!(
        "rank {rank} could not get the rendezvous from rank 0 at {target} within {timeout:?} (last: {last}): \
         check that rank 0 runs and that MASTER_ADDR names its host"
    )))
}

fn resolve(target: &str) -> std::result::Result<SocketAddr, String> {
    let mut addrs = target.to_socket_addrs().map_err(|e| format!("cannot resolve {target}: {e}"))?;
    addrs.next().ok_or_else(|| format!("{target} resolves to no address"))
}

fn connect(addr: SocketAddr, rank: usize, size: usize, deadline: Instant) -> std::result::Result<Vec<u8>, String> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
    let mut stream = TcpStream::connect_timeout(&addr, left.min(HANDSHAKE)).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
    let mut request = MAGIC.to_vec();
    request.extend_from_slice(&(rank as u32).to_le_bytes());
    request.extend_from_slice(&(size as u32).to_le_bytes());
    stream.write_all(&request).map_err(|e| e.to_string())?;
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(|e| format!("no answer ({e})"))?;
    let len = u32::from_le_bytes(len);
    if len > MAX_PAYLOAD {
        return Err(format!("an answer of {len} bytes is not a rendezvous"));
    }
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload).map_err(|e| format!("answer cut short ({e})"))?;
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> (TcpListener, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (l, port)
    }

    #[test]
    fn every_rank_gets_rank_zeros_payload() {
        let (l, port) = listener();
        let payload: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
        let fetched: Vec<_> = (1..4)
            .map(|rank| std::thread::spawn(move || fetch("127.0.0.1", port, rank, 4, Duration::from_secs(20))))
            .collect();
        serve_on(l, 4, &payload, Duration::from_secs(20)).unwrap();
        for f in fetched {
            assert_eq!(f.join().unwrap().unwrap(), payload);
        }
    }

    #[test]
    fn a_rank_that_starts_before_rank_zero_waits_for_it() {
        let (l, port) = listener();
        drop(l); // nobody listens yet
        let early = std::thread::spawn(move || fetch("127.0.0.1", port, 1, 2, Duration::from_secs(20)));
        std::thread::sleep(Duration::from_millis(300));
        serve(port, 2, b"id", Duration::from_secs(20)).unwrap();
        assert_eq!(early.join().unwrap().unwrap(), b"id");
    }

    #[test]
    fn a_missing_rank_is_named_after_the_timeout() {
        let (l, port) = listener();
        let one = std::thread::spawn(move || fetch("127.0.0.1", port, 2, 3, Duration::from_secs(20)));
        let message = serve_on(l, 3, b"id", Duration::from_millis(800)).unwrap_err().to_string();
        assert!(message.contains("ranks [1] of 3 never connected"), "{message}");
        one.join().unwrap().unwrap();
    }

    #[test]
    fn nobody_serving_is_an_error_in_bounded_time() {
        let (l, port) = listener();
        drop(l);
        let started = Instant::now();
        let message = fetch("127.0.0.1", port, 1, 2, Duration::from_millis(500)).unwrap_err().to_string();
        assert!(message.contains("rank 1 could not get the rendezvous"), "{message}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn inconsistent_launches_are_refused_and_strays_ignored() {
        let (l, port) = listener();
        let stray = std::thread::spawn(move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        });
        let wrong = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            fetch("127.0.0.1", port, 1, 5, Duration::from_secs(3))
        });
        let message = serve_on(l, 2, b"id", Duration::from_secs(20)).unwrap_err().to_string();
        assert!(message.contains("WORLD_SIZE=5") && message.contains("WORLD_SIZE=2"), "{message}");
        stray.join().unwrap();
        assert!(wrong.join().unwrap().is_err());
    }

    #[test]
    fn the_port_moves_up_under_torchruns_agent() {
        assert_eq!(port_for(29500, false).unwrap(), 29500);
        assert_eq!(port_for(29500, true).unwrap(), 29501);
        assert!(port_for(65535, true).is_err());
    }
}
