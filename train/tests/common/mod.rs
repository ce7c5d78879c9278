//! What the training tests share: the tiny fixture checkpoint, scratch folders, synthetic episodes, and
//! configs resolved from flags as the binary resolves them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use askgui_data::synth::{synth, SynthArgs};
use askgui_data::PromptConfig;
use askgui_model::{ImageProcessorConfig, QwenTokenizer};
use askgui_train::cli::from_args;
use askgui_train::data::DataOptions;
use askgui_train::TrainConfig;

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/tiny-qwen2_5_vl")
}

/// A fresh folder under the target's tmp dir.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("askgui-train-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `episodes` synthetic episodes (train split only) in `dir`; returns the JSONL path.
pub fn episodes(dir: &Path, episodes: usize) -> PathBuf {
    synth(&SynthArgs {
        out: dir.into(),
        episodes,
        seed: 11,
        width: 224,
        height: 400,
        split: "1:0:0".into(),
        ambiguous_fraction: 0.5,
        slot_colors: false,
        grid: 0,
        icons: false,
    })
    .expect("synth");
    dir.join("train.jsonl")
}

/// The config the binary would resolve from these flags (plus the fixture and tiny images).
pub fn config(data: &Path, out: &Path, flags: &str) -> TrainConfig {
    let (m, d, o) = (fixture(), data.to_path_buf(), out.to_path_buf());
    let mut argv: Vec<String> = ["askgui-train", "--model"].map(String::from).to_vec();
    argv.push(m.display().to_string());
    argv.extend(["--data".into(), d.display().to_string(), "--output-dir".into(), o.display().to_string()]);
    argv.extend(["--max-pixels", "12544", "--progress", "false"].map(String::from));
    argv.extend(flags.split_whitespace().map(String::from));
    from_args(argv).unwrap().0
}

/// OpenMPI's `mpirun` on PATH, or `None` (and a SKIPPED line) without one.
pub fn mpirun() -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).map(|dir| dir.join("mpirun")).find(|p| p.is_file()));
    if found.is_none() {
        println!("SKIPPED: mpirun is not on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)");
    }
    found
}

/// How an `mpirun` job ended.
pub struct Job {
    /// `None` when the job outlived its deadline and was killed.
    pub status: Option<std::process::ExitStatus>,
    pub elapsed: std::time::Duration,
    /// stdout then stderr.
    pub output: String,
}

/// One mpirun at a time: two jobs oversubscribing two cores would only blur the timings.
static MPIRUN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A started `mpirun` job: its pipes are read on their own threads, so that a full pipe never stalls it.
pub struct Running {
    pub child: std::process::Child,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
    start: std::time::Instant,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

/// Starts `mpirun -np ranks exe args...` in its own process group.
pub fn mpirun_start(mpirun: &Path, ranks: usize, exe: &str, args: &[String]) -> Running {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let one_at_a_time = MPIRUN.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = Command::new(mpirun)
        .args(["--oversubscribe", "-np", &ranks.to_string(), exe])
        .args(args)
        // CI runs as root, which mpirun refuses without these; harmless otherwise.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("start mpirun");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        })
    };
    let (out, err) = (drain(Box::new(child.stdout.take().unwrap())), drain(Box::new(child.stderr.take().unwrap())));
    Running { child, out, err, start: std::time::Instant::now(), _one_at_a_time: one_at_a_time }
}

impl Running {
    /// Waits for the job, killing its process group past `deadline` (counted from the start), so that a
    /// job that hangs fails the test instead of the test hanging.
    pub fn wait(mut self, deadline: std::time::Duration) -> Job {
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait for mpirun") {
                break Some(status);
            }
            if self.start.elapsed() > deadline {
                // SAFETY: kill(2) on our child's process group (mpirun and its ranks); no memory is involved.
                unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let output = format!("{}{}", self.out.join().unwrap(), self.err.join().unwrap());
        Job { status, elapsed: self.start.elapsed(), output }
    }
}

/// Runs `mpirun -np ranks exe args...` to its end or `deadline` ([`Running::wait`]).
pub fn mpirun_job(mpirun: &Path, ranks: usize, exe: &str, args: &[String], deadline: std::time::Duration) -> Job {
    mpirun_start(mpirun, ranks, exe, args).wait(deadline)
}

/// The fixture's tokenizer and image processor with the tests' small max_pixels.
pub fn tokenizer_and_images() -> (QwenTokenizer, ImageProcessorConfig) {
    let tok = QwenTokenizer::from_file(&fixture().join("tokenizer.json"), None).unwrap();
    let mut images = ImageProcessorConfig::from_file(&fixture().join("preprocessor_config.json")).unwrap();
    images.max_pixels = 12544;
    (tok, images)
}

/// What the trainer passes to the data loader for default flags, the tests' max_pixels and
/// `--history-images history_images`.
pub fn data_options(history_images: usize) -> DataOptions {
    let (_, images) = tokenizer_and_images();
    let (min_pixels, max_pixels) = (images.min_pixels, images.max_pixels);
    DataOptions {
        prompt: PromptConfig { min_pixels, max_pixels, history_images, ..Default::default() },
        task_mode: Default::default(),
        extra_task_modes: vec![],
        history_length: 0,
        max_seq_len: 8192,
        skip_bad_records: false,
        ask_repeat: 1,
        say_repeat: 1,
        dialog_repeat: 1,
        region_words: false,
    }
}
