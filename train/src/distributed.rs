//! Data-parallel communication: which process of a multi-process run this is ([`World`]) and the
//! collectives the trainer needs (gradient all-reduce, barrier, agreement checks).
//!
//! The key choice: on CPU the transport is MPI (the `mpi` crate, rsmpi), behind the cargo feature `mpi`,
//! so a plain build needs no MPI at all and `mpirun -np N askgui-train ...` runs N ranks. On GPUs it is
//! NCCL ([`crate::nccl`], feature `nccl`), set up by [`World::connect`] once the trainer has its device:
//! rank 0's NCCL id reaches the others over MPI under `mpirun`, or over [`crate::rendezvous`] at
//! `MASTER_ADDR` under torchrun. The launcher is read from the environment (OpenMPI's `OMPI_COMM_WORLD_*`,
//! MPICH/PMI's `PMI_*`, torchrun's `WORLD_SIZE`/`RANK`); a single process uses the identity backend.
//! MPI is initialised FUNNELED (rayon threads compute, only the thread that made the [`World`] calls MPI),
//! which is why [`World`] is neither `Send` nor `Sync`. Every rank ends with [`World::finish`] (which
//! finalises MPI); a World dropped without it (an error, a panic) calls `MPI_Abort`, because finalising
//! there would leave the job hanging: the others wait in their next collective, this rank in `MPI_Finalize`.
//!
//! Tests: `cargo test -p askgui-train --lib distributed` (launch parsing) and, with OpenMPI installed,
//! `cargo test -p askgui-train --features mpi --test distributed` (real all-reduces under `mpirun -np 2`).

use std::marker::PhantomData;

use thiserror::Error;

/// The errors of a distributed launch; each says what to change (the variable, the build, the launcher).
#[derive(Debug, Error)]
pub enum DistributedError {
    #[error("environment variable {var}={value:?}: {reason}")]
    BadVar { var: &'static str, value: String, reason: String },
    #[error("environment variable {var} is not set, but {set_by} is: a {launcher} launch sets both; unset {set_by} or launch through {launcher}")]
    MissingVar { var: &'static str, set_by: &'static str, launcher: &'static str },
    #[error(
        "launched as {size} processes by {launcher}, but this askgui-train was built without MPI support: rebuild \
         it with `cargo build --release -p askgui-train --features mpi` (Debian: apt-get install openmpi-bin \
         libopenmpi-dev libclang-dev), or run one process without {launcher}"
    )]
    NoMpiFeature { size: usize, launcher: &'static str },
    #[error(
        "WORLD_SIZE={size} (a torchrun/Slurm-style launch) has no transport on CPU: launch CPU runs with \
         `mpirun -np {size} askgui-train ...` on a build with `--features mpi`; torchrun-style launches are for \
         GPUs, on a build with `--features nccl` and `--device cuda`"
    )]
    TorchrunOnCpu { size: usize },
    #[error(
        "a data-parallel run of {size} ranks on a CUDA GPU needs NCCL: rebuild askgui-train with \
         `--features nccl` (add `mpi` for mpirun launches), or train on the CPU with `--device cpu`"
    )]
    NoNcclFeature { size: usize },
    #[error("rendezvous: {0}")]
    Rendezvous(String),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("MPI was already initialised (or finalised) in this process: create one World per process, once")]
    AlreadyInitialised,
    #[error(
        "{launcher} says this is rank {env_rank} of {env_size}, but MPI says rank {mpi_rank} of {mpi_size}: this \
         binary's MPI library ({library}) is not the one whose mpirun launched it; launch with the mpirun of the \
         MPI installation it was built against"
    )]
    Mismatch {
        launcher: &'static str,
        env_rank: usize,
        env_size: usize,
        mpi_rank: usize,
        mpi_size: usize,
        library: String,
    },
}

type Result<T> = std::result::Result<T, DistributedError>;

/// What started this process, as read from its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher variables: one process.
    Single,
    /// OpenMPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH's `mpiexec` or Slurm's `srun --mpi=pmi2` (`PMI_SIZE`, `PMI_RANK`).
    Pmi,
    /// torchrun or a Slurm script in its style (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`);
    /// `agent_store` when torchrun's agent serves its store on `MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE`).
    Torchrun { master_addr: String, master_port: u16, agent_store: bool },
}

impl Launcher {
    fn name(&self) -> &'static str {
        match self {
            Launcher::Single => "a single process",
            Launcher::OpenMpi => "OpenMPI's mpirun",
            Launcher::Pmi => "an MPICH/PMI launcher",
            Launcher::Torchrun { .. } => "torchrun",
        }
    }
}

/// This process's place in the launch, before any transport is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub launcher: Launcher,
    pub rank: usize,
    pub size: usize,
    /// The rank among the processes on this node (which GPU to take, later).
    pub local_rank: usize,
}

/// Reads one variable as a number; `Ok(None)` when it is unset.
fn number(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<usize>> {
    let Some(value) = get(var) else { return Ok(None) };
    match value.parse::<usize>() {
        Ok(n) => Ok(Some(n)),
        Err(e) => Err(DistributedError::BadVar { var, value, reason: format!("not a process count or rank ({e})") }),
    }
}

/// Reads `var`, which must be set because `set_by` is.
fn required(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    set_by: &'static str,
    launcher: &'static str,
) -> Result<usize> {
    number(get, var)?.ok_or(DistributedError::MissingVar { var, set_by, launcher })
}

/// Checks that a size is at least 1 and that a rank (or local rank) is below it, naming the variables.
fn check(size: (&'static str, usize), ranks: &[(&'static str, usize)]) -> Result<()> {
    let (size_var, size) = size;
    if size == 0 {
        let reason = "a launch has at least one process".into();
        return Err(DistributedError::BadVar { var: size_var, value: "0".into(), reason });
    }
    for &(var, rank) in ranks {
        if rank >= size {
            let reason = format!("must be below {size_var}={size}");
            return Err(DistributedError::BadVar { var, value: rank.to_string(), reason });
        }
    }
    Ok(())
}

/// Parses the launcher's environment through `get` (a variable's value, `None` when unset), so that it is
/// testable without touching the process environment. OpenMPI's variables win over PMI's, which win over
/// torchrun's (mpirun run inside a torchrun-style Slurm job is still an MPI launch).
pub fn parse_launch(get: impl Fn(&str) -> Option<String>) -> Result<Launch> {
    if get("OMPI_COMM_WORLD_SIZE").is_some() || get("OMPI_COMM_WORLD_RANK").is_some() {
        return parse_openmpi(&get);
    }
    if get("PMI_SIZE").is_some() || get("PMI_RANK").is_some() {
        return parse_pmi(&get);
    }
    if get("WORLD_SIZE").is_some() {
        return parse_torchrun(&get);
    }
    Ok(Launch { launcher: Launcher::Single, rank: 0, size: 1, local_rank: 0 })
}

fn parse_openmpi(get: &impl Fn(&str) -> Option<String>) -> Result<Launch> {
    let launcher = "OpenMPI mpirun";
    let size = required(get, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", launcher)?;
    let rank = required(get, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", launcher)?;
    let local_rank = required(get, "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", launcher)?;
    check(
        ("OMPI_COMM_WORLD_SIZE", size),
        &[("OMPI_COMM_WORLD_RANK", rank), ("OMPI_COMM_WORLD_LOCAL_RANK", local_rank)],
    )?;
    Ok(Launch { launcher: Launcher::OpenMpi, rank, size, local_rank })
}

/// PMI has no local rank of its own: Hydra's `MPI_LOCALRANKID` or Slurm's `SLURM_LOCALID` when set,
/// else the rank (one node).
fn parse_pmi(get: &impl Fn(&str) -> Option<String>) -> Result<Launch> {
    let launcher = "PMI (mpiexec/srun)";
    let size = required(get, "PMI_SIZE", "PMI_RANK", launcher)?;
    let rank = required(get, "PMI_RANK", "PMI_SIZE", launcher)?;
    let (local_var, local_rank) = match (number(get, "MPI_LOCALRANKID")?, number(get, "SLURM_LOCALID")?) {
        (Some(l), _) => ("MPI_LOCALRANKID", l),
        (None, Some(l)) => ("SLURM_LOCALID", l),
        (None, None) => ("PMI_RANK", rank),
    };
    check(("PMI_SIZE", size), &[("PMI_RANK", rank), (local_var, local_rank)])?;
    Ok(Launch { launcher: Launcher::Pmi, rank, size, local_rank })
}

/// `WORLD_SIZE=1` alone (as some job scripts export) is one process; above 1 every torchrun variable is
/// required.
fn parse_torchrun(get: &impl Fn(&str) -> Option<String>) -> Result<Launch> {
    let launcher = "torchrun";
    let size = required(get, "WORLD_SIZE", "WORLD_SIZE", launcher)?;
    let (rank, local_rank) = if size > 1 {
        (required(get, "RANK", "WORLD_SIZE", launcher)?, required(get, "LOCAL_RANK", "WORLD_SIZE", launcher)?)
    } else {
        (number(get, "RANK")?.unwrap_or(0), number(get, "LOCAL_RANK")?.unwrap_or(0))
    };
    check(("WORLD_SIZE", size), &[("RANK", rank), ("LOCAL_RANK", local_rank)])?;
    let master_addr = get("MASTER_ADDR").unwrap_or_default();
    let port_text = get("MASTER_PORT");
    if size > 1 && master_addr.is_empty() {
        return Err(DistributedError::MissingVar { var: "MASTER_ADDR", set_by: "WORLD_SIZE", launcher });
    }
    let master_port = match port_text {
        None if size > 1 => {
            return Err(DistributedError::MissingVar { var: "MASTER_PORT", set_by: "WORLD_SIZE", launcher })
        }
        None => 0,
        Some(value) => value.parse::<u16>().map_err(|e| DistributedError::BadVar {
            var: "MASTER_PORT",
            value: value.clone(),
            reason: format!("not a TCP port ({e})"),
        })?,
    };
    let agent_store = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    Ok(Launch { launcher: Launcher::Torchrun { master_addr, master_port, agent_store }, rank, size, local_rank })
}

/// The MPI state of a multi-process run; `universe` is `None` once [`World::finish`] has finalised MPI.
#[cfg(feature = "mpi")]
struct Mpi {
    rank: usize,
    world: mpi::topology::SimpleCommunicator,
    universe: Option<mpi::environment::Universe>,
}

/// A rank that leaves without [`World::finish`] (an error returned up to `main`, a panic) aborts the whole
/// job. Finalising instead would hang it: `MPI_Finalize` waits for the other ranks, which wait for this one
/// in their next collective.
#[cfg(feature = "mpi")]
impl Drop for Mpi {
    fn drop(&mut self) {
        if self.universe.is_some() {
            let rank = self.rank;
            tracing::error!(
                rank,
                "rank {rank} is leaving the run without World::finish (an error or a panic): aborting every rank"
            );
            mpi::traits::Communicator::abort(&self.world, 1);
        }
    }
}

enum Backend {
    /// One process: every collective is the identity.
    Single,
    #[cfg(feature = "mpi")]
    Mpi(Mpi),
    /// A torchrun-style launch: no transport until [`World::connect`] sets up NCCL on a GPU (where the
    /// rendezvous address is read).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    Torchrun { master_addr: String, port: u16 },
}

/// This process in a data-parallel run: its rank, the number of ranks, and the transport between them.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    backend: Backend,
    /// The GPU transport, once [`World::connect`] has set it up; it then carries every collective.
    #[cfg(feature = "nccl")]
    nccl: std::cell::OnceCell<crate::nccl::Nccl>,
    /// Not `Send`/`Sync`: MPI was initialised FUNNELED, so only the thread that made the World may call it.
    _funneled: PhantomData<*const ()>,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backend = match self.backend {
            _ if self.has_nccl() => "nccl",
            Backend::Single => "single",
            #[cfg(feature = "mpi")]
            Backend::Mpi(_) => "mpi",
            Backend::Torchrun { .. } => "torchrun (not connected)",
        };
        f.debug_struct("World")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("backend", &backend)
            .finish()
    }
}

impl World {
    /// One process, no transport (what a plain run uses).
    pub fn single() -> World {
        World::new(0, 1, 0, Backend::Single)
    }

    fn new(rank: usize, size: usize, local_rank: usize, backend: Backend) -> World {
        World {
            rank,
            size,
            local_rank,
            backend,
            #[cfg(feature = "nccl")]
            nccl: std::cell::OnceCell::new(),
            _funneled: PhantomData,
        }
    }

    /// This process as its launcher started it: one process without launcher variables (or a launch of
    /// one), else MPI for `mpirun`/PMI launches (with the `mpi` feature; an error without it), and an
    /// error for a multi-process torchrun-style launch, which has no CPU transport. OpenMPI 4.1 binds
    /// each rank to one core by default (for `-np` up to 2), so rayon gets one thread per rank: give ranks
    /// several cores with `--map-by slot:PE=K` or lift the binding with `--bind-to none`.
    pub fn from_env() -> Result<World> {
        let launch = parse_launch(|var| std::env::var_os(var).map(|v| v.to_string_lossy().into_owned()))?;
        World::from_launch(launch)
    }

    fn from_launch(launch: Launch) -> Result<World> {
        if launch.size == 1 || launch.launcher == Launcher::Single {
            return Ok(World::single());
        }
        let backend = match &launch.launcher {
            Launcher::Torchrun { .. } if !cfg!(feature = "nccl") => {
                return Err(DistributedError::TorchrunOnCpu { size: launch.size })
            }
            Launcher::Torchrun { master_addr, master_port, agent_store } => Backend::Torchrun {
                master_addr: master_addr.clone(),
                port: crate::rendezvous::port_for(*master_port, *agent_store)?,
            },
            _ => init_mpi(&launch)?,
        };
        let world = World::new(launch.rank, launch.size, launch.local_rank, backend);
        // mpirun pins ranks to cores, which bounds rayon's threads: worth seeing in the log.
        let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        tracing::info!(
            rank = world.rank,
            size = world.size,
            local_rank = world.local_rank,
            cpus,
            "joined the data-parallel run"
        );
        Ok(world)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Rank 0: the one that logs, evaluates and writes checkpoints.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// Sums `buf` element-wise over all ranks, in place; every rank must call it with the same length.
    pub fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce_sum(buf)
    }

    /// [`World::all_reduce_sum_f32`] for f64 buffers (loss sums, token counts).
    pub fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.all_reduce_sum(buf)
    }

    #[cfg_attr(not(feature = "mpi"), allow(unused_variables))] // one process: the sum is `buf` itself
    fn all_reduce_sum<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = self.nccl.get() {
            return nccl.all_reduce_sum(buf);
        }
        match &self.backend {
            Backend::Single => Ok(()),
            #[cfg(feature = "mpi")]
            Backend::Mpi(mpi) => {
                mpi.all_reduce_sum(buf);
                Ok(())
            }
            Backend::Torchrun { .. } => Err(DistributedError::TorchrunOnCpu { size: self.size }),
        }
    }

    /// Waits until every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = self.nccl.get() {
            return nccl.barrier();
        }
        match &self.backend {
            Backend::Single => Ok(()),
            #[cfg(feature = "mpi")]
            Backend::Mpi(mpi) => {
                mpi::traits::CommunicatorCollectives::barrier(&mpi.world);
                Ok(())
            }
            Backend::Torchrun { .. } => Err(DistributedError::TorchrunOnCpu { size: self.size }),
        }
    }

    /// Every rank's `x`, in rank order.
    pub fn all_gather_u64(&self, x: u64) -> Result<Vec<u64>> {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = self.nccl.get() {
            return nccl.all_gather_u64(x, self.size);
        }
        match &self.backend {
            Backend::Single => Ok(vec![x]),
            #[cfg(feature = "mpi")]
            Backend::Mpi(mpi) => {
                let mut all = vec![0u64; self.size];
                mpi::traits::CommunicatorCollectives::all_gather_into(&mpi.world, &x, &mut all[..]);
                Ok(all)
            }
            Backend::Torchrun { .. } => Err(DistributedError::TorchrunOnCpu { size: self.size }),
        }
    }

    /// The GPU this rank should train on: its local rank, or 0 when the launcher shows each rank a single
    /// GPU. 0 for one process and for builds without NCCL.
    pub fn gpu_ordinal(&self) -> Result<usize> {
        #[cfg(feature = "nccl")]
        if self.size > 1 {
            return crate::nccl::device_ordinal(self.local_rank);
        }
        Ok(0)
    }

    /// Sets up the transport for the trainer's `device`, on every rank, before the first collective. On the
    /// CPU that is the MPI of the launch (a torchrun-style launch has none: an error). On a CUDA GPU it is
    /// NCCL: rank 0 makes the unique id, which reaches the others over MPI or the rendezvous, and every
    /// collective then runs through NCCL.
    pub fn connect(&self, device: &candle_core::Device) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        if !device.is_cuda() {
            return match self.backend {
                Backend::Torchrun { .. } => Err(DistributedError::TorchrunOnCpu { size: self.size }),
                _ => Ok(()),
            };
        }
        self.connect_nccl(device)
    }

    #[cfg(not(feature = "nccl"))]
    fn connect_nccl(&self, _device: &candle_core::Device) -> Result<()> {
        Err(DistributedError::NoNcclFeature { size: self.size })
    }

    #[cfg(feature = "nccl")]
    fn connect_nccl(&self, device: &candle_core::Device) -> Result<()> {
        let stream = match device {
            candle_core::Device::Cuda(d) => d.cuda_stream(),
            _ => unreachable!("connect_nccl is called for CUDA devices"),
        };
        let id = self.share_nccl_id()?;
        let nccl = crate::nccl::Nccl::connect(stream, self.rank, self.size, id)?;
        if self.nccl.set(nccl).is_err() {
            return Err(DistributedError::Nccl("World::connect was called twice".into()));
        }
        tracing::info!(rank = self.rank, size = self.size, ?device, "NCCL communicator ready");
        Ok(())
    }

    /// Rank 0's fresh NCCL id, on every rank.
    #[cfg(feature = "nccl")]
    fn share_nccl_id(&self) -> Result<[u8; crate::nccl::ID_BYTES]> {
        use crate::rendezvous;
        const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);
        let mut id = if self.rank == 0 { crate::nccl::new_id()? } else { [0; crate::nccl::ID_BYTES] };
        match &self.backend {
            Backend::Single => {}
            #[cfg(feature = "mpi")]
            Backend::Mpi(mpi) => {
                use mpi::traits::{Communicator, Root};
                mpi.world.process_at_rank(0).broadcast_into(&mut id[..]);
            }
            Backend::Torchrun { port, .. } if self.rank == 0 => rendezvous::serve(*port, self.size, &id, TIMEOUT)?,
            Backend::Torchrun { master_addr, port } => {
                let bytes = rendezvous::fetch(master_addr, *port, self.rank, self.size, TIMEOUT)?;
                id = bytes.try_into().map_err(|b: Vec<u8>| {
                    DistributedError::Rendezvous(format!("rank 0 sent {} bytes, not an NCCL id", b.len()))
                })?;
            }
        }
        Ok(id)
    }

    fn has_nccl(&self) -> bool {
        #[cfg(feature = "nccl")]
        let set = self.nccl.get().is_some();
        #[cfg(not(feature = "nccl"))]
        let set = false;
        set
    }

    /// The clean end of a run, on every rank: finalises MPI (which waits for all ranks). A World dropped
    /// without it, on an error or panic path, aborts every rank instead, so that none waits forever.
    /// A torchrun launch has no such abort: its agent ends the other ranks when one exits with an error.
    pub fn finish(mut self) {
        #[cfg(feature = "nccl")]
        if let Some(nccl) = self.nccl.take() {
            if let Err(e) = nccl.barrier() {
                tracing::warn!("NCCL barrier at the end of the run: {e}");
            }
        }
        match &mut self.backend {
            Backend::Single | Backend::Torchrun { .. } => {}
            #[cfg(feature = "mpi")]
            Backend::Mpi(mpi) => drop(mpi.universe.take()),
        }
    }

    /// Whether every rank passed the same `x` (a resumed step, a checkpoint's world size). Every rank gets
    /// the same answer, so all of them take the same branch on it and none is left waiting.
    pub fn all_equal_u64(&self, x: u64) -> Result<bool> {
        Ok(self.all_gather_u64(x)?.iter().all(|&y| y == x))
    }
}

/// What a collective's buffers hold: plain numbers that every enabled transport can sum.
trait Element: MpiElement + NcclElement + Copy {}
impl<T: MpiElement + NcclElement + Copy> Element for T {}
#[cfg(feature = "mpi")]
trait MpiElement: mpi::datatype::Equivalence {}
#[cfg(feature = "mpi")]
impl<T: mpi::datatype::Equivalence> MpiElement for T {}
#[cfg(not(feature = "mpi"))]
trait MpiElement {}
#[cfg(not(feature = "mpi"))]
impl<T> MpiElement for T {}
#[cfg(feature = "nccl")]
trait NcclElement: cudarc::nccl::NcclType + cudarc::driver::DeviceRepr {}
#[cfg(feature = "nccl")]
impl<T: cudarc::nccl::NcclType + cudarc::driver::DeviceRepr> NcclElement for T {}
#[cfg(not(feature = "nccl"))]
trait NcclElement {}
#[cfg(not(feature = "nccl"))]
impl<T> NcclElement for T {}

/// Elements per MPI call: MPI counts are C ints, and the send copy stays at 64 MiB of f32.
#[cfg(feature = "mpi")]
const CHUNK: usize = 1 << 24;

#[cfg(feature = "mpi")]
impl Mpi {
    /// In-place sum through a send copy of each chunk (rsmpi has no `MPI_IN_PLACE`).
    fn all_reduce_sum<T: mpi::datatype::Equivalence + Copy>(&self, buf: &mut [T]) {
        use mpi::traits::CommunicatorCollectives;
        let mut send = Vec::with_capacity(buf.len().min(CHUNK));
        for chunk in buf.chunks_mut(CHUNK) {
            send.clear();
            send.extend_from_slice(chunk);
            self.world.all_reduce_into(&send[..], chunk, mpi::collective::SystemOperation::sum());
        }
    }
}

/// Initialises MPI FUNNELED and checks that it sees the ranks the launcher's variables announced.
#[cfg(feature = "mpi")]
fn init_mpi(launch: &Launch) -> Result<Backend> {
    use mpi::traits::Communicator;
    let (universe, level) =
        mpi::initialize_with_threading(mpi::Threading::Funneled).ok_or(DistributedError::AlreadyInitialised)?;
    let library = mpi::environment::library_version().unwrap_or_default().trim().to_string();
    if level == mpi::Threading::Single {
        tracing::warn!(%library, "this MPI provides MPI_THREAD_SINGLE only; the trainer's compute threads never call MPI");
    }
    let world = universe.world();
    // MPI ranks and sizes are never negative; a failed conversion shows up as a mismatch.
    let mpi_rank = usize::try_from(world.rank()).unwrap_or(usize::MAX);
    let mpi_size = usize::try_from(world.size()).unwrap_or(usize::MAX);
    if (mpi_rank, mpi_size) != (launch.rank, launch.size) {
        return Err(DistributedError::Mismatch {
            launcher: launch.launcher.name(),
            env_rank: launch.rank,
            env_size: launch.size,
            mpi_rank,
            mpi_size,
            library,
        });
    }
    tracing::debug!(%library, ?level, "MPI initialised");
    Ok(Backend::Mpi(Mpi { rank: mpi_rank, world, universe: Some(universe) }))
}

#[cfg(not(feature = "mpi"))]
fn init_mpi(launch: &Launch) -> Result<Backend> {
    Err(DistributedError::NoMpiFeature { size: launch.size, launcher: launch.launcher.name() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<Launch> {
        let vars: std::collections::HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        parse_launch(|k| vars.get(k).cloned())
    }

    fn bad_var(result: Result<Launch>) -> (&'static str, String, String) {
        match result {
            Err(e @ DistributedError::BadVar { .. }) => {
                let message = e.to_string();
                let DistributedError::BadVar { var, value, .. } = e else { unreachable!() };
                (var, value, message)
            }
            other => panic!("expected a bad variable, got {other:?}"),
        }
    }

    #[test]
    fn no_variables_is_one_process() {
        let launch = parse(&[]).unwrap();
        assert_eq!(launch, Launch { launcher: Launcher::Single, rank: 0, size: 1, local_rank: 0 });
        let world = World::from_launch(launch).unwrap();
        assert_eq!((world.rank(), world.size(), world.is_main()), (0, 1, true));
    }

    #[test]
    fn openmpi_variables() {
        let vars = [("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")];
        assert_eq!(parse(&vars).unwrap(), Launch { launcher: Launcher::OpenMpi, rank: 3, size: 4, local_rank: 1 });
    }

    #[test]
    fn openmpi_wins_over_torchrun_variables() {
        let vars = [
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("WORLD_SIZE", "8"),
            ("RANK", "5"),
        ];
        assert_eq!(parse(&vars).unwrap().launcher, Launcher::OpenMpi);
    }

    #[test]
    fn pmi_variables() {
        let launch = parse(&[("PMI_SIZE", "3"), ("PMI_RANK", "2")]).unwrap();
        assert_eq!(launch, Launch { launcher: Launcher::Pmi, rank: 2, size: 3, local_rank: 2 });
        let launch = parse(&[("PMI_SIZE", "4"), ("PMI_RANK", "3"), ("MPI_LOCALRANKID", "1")]).unwrap();
        assert_eq!(launch.local_rank, 1);
        let launch = parse(&[("PMI_SIZE", "4"), ("PMI_RANK", "3"), ("SLURM_LOCALID", "0")]).unwrap();
        assert_eq!(launch.local_rank, 0);
    }

    #[test]
    fn torchrun_variables() {
        let vars = [
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let launch = parse(&vars).unwrap();
        let launcher = Launcher::Torchrun { master_addr: "127.0.0.1".into(), master_port: 29500, agent_store: false };
        assert_eq!(launch, Launch { launcher, rank: 1, size: 2, local_rank: 1 });
        // Refused at launch without NCCL, at connect with it: either way a CPU run is told to use mpirun.
        let on_cpu = World::from_launch(launch).and_then(|w| w.connect(&candle_core::Device::Cpu).map(|_| w));
        let message = on_cpu.unwrap_err().to_string();
        assert!(message.contains("mpirun -np 2"), "{message}");
    }

    #[test]
    fn torchrun_world_of_one_needs_no_master() {
        let launch = parse(&[("WORLD_SIZE", "1")]).unwrap();
        assert_eq!((launch.rank, launch.size, launch.local_rank), (0, 1, 0));
        assert_eq!(World::from_launch(launch).unwrap().size(), 1);
    }

    #[test]
    fn torchrun_missing_variables_are_named() {
        let message = parse(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")]).unwrap_err().to_string();
        assert!(message.contains("MASTER_ADDR"), "{message}");
        let message = parse(&[("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err().to_string();
        assert!(message.contains("RANK is not set"), "{message}");
        let vars =
            [("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "x")];
        assert_eq!(bad_var(parse(&vars)).0, "MASTER_PORT");
    }

    #[test]
    fn rank_not_below_size_is_refused() {
        let vars = [("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "0")];
        let (var, value, message) = bad_var(parse(&vars));
        assert_eq!((var, value.as_str()), ("OMPI_COMM_WORLD_RANK", "2"));
        assert!(message.contains("OMPI_COMM_WORLD_SIZE=2"), "{message}");
        let (var, ..) = bad_var(parse(&[("PMI_SIZE", "2"), ("PMI_RANK", "0"), ("MPI_LOCALRANKID", "5")]));
        assert_eq!(var, "MPI_LOCALRANKID");
    }

    #[test]
    fn non_numbers_and_zero_sizes_are_refused() {
        let (var, value, message) = bad_var(parse(&[("PMI_SIZE", "two"), ("PMI_RANK", "0")]));
        assert_eq!((var, value.as_str()), ("PMI_SIZE", "two"));
        assert!(message.contains("PMI_SIZE=\"two\""), "{message}");
        assert_eq!(bad_var(parse(&[("PMI_SIZE", "2"), ("PMI_RANK", "-1")])).0, "PMI_RANK");
        let (var, value, _) = bad_var(parse(&[("WORLD_SIZE", "0")]));
        assert_eq!((var, value.as_str()), ("WORLD_SIZE", "0"));
        let vars = [("OMPI_COMM_WORLD_SIZE", "0"), ("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_LOCAL_RANK", "0")];
        assert_eq!(bad_var(parse(&vars)).0, "OMPI_COMM_WORLD_SIZE");
    }

    #[test]
    fn half_set_launcher_variables_are_refused() {
        let message = parse(&[("OMPI_COMM_WORLD_RANK", "0")]).unwrap_err().to_string();
        assert!(message.contains("OMPI_COMM_WORLD_SIZE is not set"), "{message}");
        let message = parse(&[("PMI_SIZE", "2")]).unwrap_err().to_string();
        assert!(message.contains("PMI_RANK is not set"), "{message}");
    }

    #[test]
    fn single_world_collectives_are_identities() {
        let world = World::single();
        let mut f = [1.5f32, -2.0];
        world.all_reduce_sum_f32(&mut f).unwrap();
        assert_eq!(f, [1.5, -2.0]);
        let mut d = [3.25f64];
        world.all_reduce_sum_f64(&mut d).unwrap();
        assert_eq!(d, [3.25]);
        world.barrier().unwrap();
        assert_eq!(world.all_gather_u64(7).unwrap(), vec![7]);
        assert!(world.all_equal_u64(7).unwrap());
    }

    /// Without the feature an mpirun launch is refused with the rebuild command.
    #[cfg(not(feature = "mpi"))]
    #[test]
    fn mpi_launch_without_the_feature_says_to_rebuild() {
        let launch = Launch { launcher: Launcher::OpenMpi, rank: 0, size: 2, local_rank: 0 };
        let message = World::from_launch(launch).unwrap_err().to_string();
        assert!(message.contains("--features mpi"), "{message}");
    }
}
