//! Coordinate frames: screen pixels of the original screenshot <-> the frame the model reads and writes.
//!
//! Datasets store screen pixels. Qwen2.5-VL points in absolute pixels of the *smart-resized* image the
//! vision tower saw; Qwen2-VL / UI-TARS-1.0 style models point in relative 0..1000 coordinates. The
//! resized size comes from `askgui_kernels::smart_resize`, the function the model's preprocessing uses,
//! so the two can never disagree. Train, serve and eval all convert through [`FrameMap`].

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::action::Action;

/// The side of one language-model token in pixels for Qwen2/2.5-VL: patch 14 x merge 2. Qwen3-VL's is 32
/// (patch 16); the model's image processor says which ([`ResizeBounds::token_side`]).
pub const QWEN2_TOKEN_SIDE: usize = 28;
pub const DEFAULT_MIN_PIXELS: usize = 56 * 56;
pub const DEFAULT_MAX_PIXELS: usize = 28 * 28 * 1280;

#[derive(Debug, Error, PartialEq)]
pub enum FrameError {
    #[error("screen {width}x{height}: {source}")]
    Resize { width: u32, height: u32, source: askgui_kernels::tiling::TilingError },
}

/// The model's coordinate convention.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum FrameKind {
    /// Absolute pixels of the smart-resized image (Qwen2.5-VL).
    #[default]
    Resized,
    /// Relative 0..1000 on both axes (Qwen2-VL, UI-TARS-1.0).
    Relative1000,
    /// Screen pixels unchanged (for endpoints that see the original screenshot).
    Screen,
}

/// The pixel bounds and token side of the image processor the model uses (they decide the resized size).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizeBounds {
    pub min_pixels: usize,
    pub max_pixels: usize,
    /// Both resized sides are multiples of it: patch x merge (28, or 32 for Qwen3-VL).
    #[serde(default = "qwen2_token_side")]
    pub token_side: usize,
}

pub(crate) fn qwen2_token_side() -> usize {
    QWEN2_TOKEN_SIDE
}

impl Default for ResizeBounds {
    fn default() -> Self {
        Self { min_pixels: DEFAULT_MIN_PIXELS, max_pixels: DEFAULT_MAX_PIXELS, token_side: QWEN2_TOKEN_SIDE }
    }
}

/// The mapping between one screen and the model frame.
#[derive(Serialize, Debug, Clone, Copy, PartialEq)]
pub struct FrameMap {
    pub kind: FrameKind,
    pub screen: (u32, u32),
    /// The size of the model frame: the resized image, (1000, 1000), or the screen.
    pub model: (u32, u32),
}

impl FrameMap {
    pub fn new(kind: FrameKind, screen_w: u32, screen_h: u32, bounds: ResizeBounds) -> Result<Self, FrameError> {
        let model = match kind {
            FrameKind::Resized => {
                let (h, w) = askgui_kernels::smart_resize(
                    screen_h as usize,
                    screen_w as usize,
                    bounds.token_side,
                    bounds.min_pixels,
                    bounds.max_pixels,
                )
                .map_err(|source| FrameError::Resize { width: screen_w, height: screen_h, source })?;
                (w as u32, h as u32)
            }
            FrameKind::Relative1000 => (1000, 1000),
            FrameKind::Screen => (screen_w, screen_h),
        };
        Ok(Self { kind, screen: (screen_w, screen_h), model })
    }

    /// Model frame units per screen pixel, per axis: `(sx, sy)`.
    pub fn resize_factors(&self) -> (f64, f64) {
        (self.model.0 as f64 / self.screen.0 as f64, self.model.1 as f64 / self.screen.1 as f64)
    }

    /// Screen pixel -> model frame (rounded; clamped into the frame).
    pub fn to_model(&self, x: i32, y: i32) -> (i32, i32) {
        let (sx, sy) = self.resize_factors();
        (scale(x, sx, self.model.0), scale(y, sy, self.model.1))
    }

    /// Model frame -> screen pixel (rounded; clamped onto the screen, so a model's 1000 is the last pixel).
    pub fn to_screen(&self, x: i32, y: i32) -> (i32, i32) {
        let (sx, sy) = self.resize_factors();
        (scale(x, 1.0 / sx, self.screen.0), scale(y, 1.0 / sy, self.screen.1))
    }

    pub fn action_to_model(&self, a: &Action) -> Action {
        a.map_points(|x, y| self.to_model(x, y))
    }

    pub fn action_to_screen(&self, a: &Action) -> Action {
        a.map_points(|x, y| self.to_screen(x, y))
    }
}

/// Pixel position `v` of an axis `from` long, in an axis `to` long (pixel centres scale, as [`scale`]).
pub fn rescale(v: i32, from: u32, to: u32) -> i32 {
    scale(v, f64::from(to) / f64::from(from.max(1)), to)
}

/// Maps a pixel *position* through a scale: pixel centres scale (`(x + 0.5) * s - 0.5`), so that the
/// round trip screen -> model -> screen lands within one model unit of where it started.
fn scale(v: i32, s: f64, extent: u32) -> i32 {
    let out = ((v as f64 + 0.5) * s - 0.5).round();
    out.clamp(0.0, extent.saturating_sub(1) as f64) as i32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::Target;
    use proptest::prelude::*;

    #[test]
    fn resized_frame_is_the_processor_size() {
        // 1024x768 desktop -> 1036x756 (grid 74x54, as transformers gives); phone 1080x2400 -> 672x1484.
        let m = FrameMap::new(FrameKind::Resized, 1024, 768, ResizeBounds::default()).unwrap();
        assert_eq!(m.model, (1036, 756));
        let m = FrameMap::new(FrameKind::Resized, 1080, 2400, ResizeBounds::default()).unwrap();
        assert_eq!(m.model, (672, 1484));
        assert_eq!(m.to_model(0, 0), (0, 0));
        assert_eq!(m.to_model(1079, 2399), (671, 1483));
        // Qwen3-VL's 32-px tokens: 1024x768 is already a multiple of 32 and within the bounds.
        let q3 = ResizeBounds { min_pixels: 65_536, max_pixels: 16_777_216, token_side: 32 };
        assert_eq!(FrameMap::new(FrameKind::Resized, 1024, 768, q3).unwrap().model, (1024, 768));
        let e = FrameMap::new(FrameKind::Resized, 1, 300, ResizeBounds::default()).unwrap_err();
        assert!(e.to_string().contains("1x300") && e.to_string().contains("aspect"), "{e}");
    }

    #[test]
    fn relative_frame_and_actions() {
        let m = FrameMap::new(FrameKind::Relative1000, 1080, 2400, ResizeBounds::default()).unwrap();
        assert_eq!(m.to_model(540, 1200), (500, 500));
        assert_eq!(m.to_screen(1000, 1000), (1079, 2399));
        let a = Action::Click(Target::point(540, 1200));
        assert_eq!(m.action_to_model(&a), Action::Click(Target::point(500, 500)));
    }

    proptest! {
        #[test]
        fn round_trip_stays_within_one_model_unit(
            w in 64u32..4000, h in 64u32..4000, fx in 0f64..1.0, fy in 0f64..1.0, rel in any::<bool>()
        ) {
            prop_assume!(w.max(h) as f64 / w.min(h) as f64 <= 200.0);
            let kind = if rel { FrameKind::Relative1000 } else { FrameKind::Resized };
            let m = FrameMap::new(kind, w, h, ResizeBounds::default()).unwrap();
            let (x, y) = ((fx * (w - 1) as f64) as i32, (fy * (h - 1) as f64) as i32);
            let (mx, my) = m.to_model(x, y);
            prop_assert!(mx >= 0 && (mx as u32) < m.model.0 && my >= 0 && (my as u32) < m.model.1);
            let (bx, by) = m.to_screen(mx, my);
            let (sx, sy) = m.resize_factors();
            // One model unit is 1/s screen pixels; rounding twice costs at most that plus one pixel.
            prop_assert!(((bx - x).abs() as f64) <= 1.0 / sx + 1.0, "x {} -> {} -> {}", x, mx, bx);
            prop_assert!(((by - y).abs() as f64) <= 1.0 / sy + 1.0, "y {} -> {} -> {}", y, my, by);
        }
    }
}
