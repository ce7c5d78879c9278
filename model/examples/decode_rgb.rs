//! Decodes an image file with askgui's own decoder and writes its RGB8 pixels raw, row by row, for the
//! fixture script: transformers then reads exactly the pixels askgui reads, so a parity case on a JPEG
//! compares the two models and not the two JPEG decoders (PIL's libjpeg-turbo and the `image` crate round
//! some pixels differently; `tests/preprocess.rs` measures that apart).
//!
//!     cargo run -p askgui-model --example decode_rgb -- IMAGE OUT.rgb    # prints "WIDTH HEIGHT"

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [image, out] = args.as_slice() else { anyhow::bail!("usage: decode_rgb IMAGE OUT.rgb") };
    let img = askgui_model::load_image(std::path::Path::new(image), usize::MAX)?;
    std::fs::write(out, img.as_raw())?;
    println!("{} {}", img.width(), img.height());
    Ok(())
}
