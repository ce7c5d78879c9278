//! `askgui-train check-gpu --device cpu`, as CI runs it: through the library, every f32 row passes and no
//! row fails (bf16 rows pass or, where the CPU refuses bf16, say `unsupported`), and every op of the
//! kernels is in the table; through the binary, it exits 0 and prints the same table, and `--help` works.

use std::process::Command;

use askgui_kernels::selfcheck::{self, Status, OPS};
use askgui_model::DeviceKind;
use askgui_train::check_gpu::{check_gpu, CheckGpuArgs};
use candle_core::DType;

#[test]
fn every_kernel_matches_its_reference_on_the_cpu() -> anyhow::Result<()> {
    let rows = check_gpu(&CheckGpuArgs { device: DeviceKind::Cpu })?;
    let table = selfcheck::table(&rows);
    eprintln!("{table}");
    assert!(selfcheck::all_passed(&rows), "a check failed:\n{table}");
    for r in &rows {
        match (&r.status, r.dtype, r.op) {
            (Status::Pass, ..) => assert!(r.worst_vs_tol <= 1.0, "{r:?}"),
            // The CPU has no tiling kernel: its path is the reference.
            (Status::Unsupported(_), _, "tiling") => {}
            (Status::Unsupported(_), DType::BF16, _) => {}
            _ => panic!("{} {} {:?} {}: {:?}", r.op, r.case, r.dtype, r.tensor, r.status),
        }
    }
    for op in OPS {
        assert!(rows.iter().any(|r| r.op == op), "the table does not name `{op}`:\n{table}");
        let passed = rows.iter().any(|r| r.op == op && r.dtype == DType::F32 && r.status == Status::Pass);
        assert!(passed || op == "tiling", "`{op}` has no passing f32 row:\n{table}");
    }
    // Forward and every gradient input are compared: attention has q, k and v.
    for tensor in ["forward", "grad q", "grad k", "grad v", "grad w", "grad b", "grad logits"] {
        assert!(rows.iter().any(|r| r.tensor == tensor), "no `{tensor}` row");
    }
    Ok(())
}

#[test]
fn the_binary_prints_the_table_and_exits_zero() {
    let bin = env!("CARGO_BIN_EXE_askgui-train");
    let out = Command::new(bin).args(["check-gpu", "--device", "cpu"]).output().expect("askgui-train runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "exit {:?}\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    for op in OPS {
        assert!(stdout.contains(op), "no `{op}` in\n{stdout}");
    }
    assert!(stdout.contains(" 0 FAIL"), "{stdout}");

    let help = Command::new(bin).args(["check-gpu", "--help"]).output().expect("askgui-train runs");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success() && text.contains("askgui-train check-gpu") && text.contains("--device"), "{text}");
}
