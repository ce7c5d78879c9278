//! Every failure the server answers, mapped to an HTTP status in ONE place, with a JSON body that tells the
//! caller what to fix: `{"error": {"message": ..., "type": ...}}` ([`askgui_data::agent_api::ApiError`]'s
//! shape, plus OpenAI's optional `code`), and `Retry-After` on 429 and 503.
//!
//! Handlers return `Result<_, HttpError>`; the `From` impls below are the mapping from each layer's error
//! (request checks, queue, backend, JSON extraction) to a status.

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::{error::JsonPayloadError, HttpResponse, ResponseError};
use askgui_data::agent_api::{ApiError, RequestError};
use serde_json::json;

use crate::backend::BackendError;
use crate::engine::{CallError, SubmitError};

/// An error answer: status, message, and the extras some statuses carry.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's machine-readable code (e.g. `model_not_found`), when there is one.
    pub code: Option<&'static str>,
    /// Seconds for `Retry-After` (429, 503).
    pub retry_after: Option<u32>,
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status.as_u16(), self.message)
    }
}

impl HttpError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        let retry_after = matches!(status.as_u16(), 429 | 503).then_some(1);
        Self { status, message: message.into(), code: None, retry_after }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    pub fn too_many(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The error type on the wire: OpenAI's `invalid_request_error` for a named code, else by status.
    pub fn kind(&self) -> &'static str {
        match self.code {
            Some(_) if self.status.is_client_error() => askgui_data::agent_api::ERROR_INVALID_REQUEST,
            _ => ApiError::kind_for_status(self.status.as_u16()),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(ApiError::new(self.kind(), self.message.clone()))
            .unwrap_or_else(|_| json!({"error": {"message": self.message, "type": self.kind()}}));
        if let (Some(code), Some(err)) = (self.code, v.get_mut("error").and_then(|e| e.as_object_mut())) {
            err.insert("code".into(), json!(code));
        }
        v
    }

    /// The JSON extractor's failures: too large is 413, anything else (syntax, types, missing fields,
    /// a broken upload) is the client's 400 with serde's message, which names the line and column.
    pub fn from_json(e: &JsonPayloadError) -> Self {
        match e {
            JsonPayloadError::OverflowKnownLength { length, limit } => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is {length} bytes, above this server's limit of {limit} (--max-body-bytes); send a smaller screenshot"),
            ),
            JsonPayloadError::Overflow { limit } => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is above this server's limit of {limit} bytes (--max-body-bytes); send a smaller screenshot"),
            ),
            JsonPayloadError::Deserialize(e) => Self::bad_request(format!("the body is not a valid request: {e}")),
            JsonPayloadError::ContentType => Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send the body as JSON (Content-Type: application/json)",
            ),
            other => Self::bad_request(format!("cannot read the body: {other}")),
        }
    }
}

impl ResponseError for HttpError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status);
        if let Some(s) = self.retry_after {
            res.insert_header((header::RETRY_AFTER, HeaderValue::from(s)));
        }
        res.json(self.body())
    }
}

impl From<RequestError> for HttpError {
    fn from(e: RequestError) -> Self {
        Self::bad_request(e.to_string())
    }
}

impl From<SubmitError> for HttpError {
    fn from(e: SubmitError) -> Self {
        let status = match e {
            SubmitError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            SubmitError::Loading | SubmitError::Failed(_) | SubmitError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
        };
        let mut err = Self::new(status, e.to_string());
        if let SubmitError::QueueFull { retry_after, .. } = e {
            err.retry_after = Some(retry_after);
        }
        if matches!(e, SubmitError::Failed(_)) {
            // Retrying will not help until the server is restarted with a working model.
            err.retry_after = None;
        }
        err
    }
}

impl From<BackendError> for HttpError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::BadInput(_) | BackendError::UnknownAdapter { .. } | BackendError::ContextOverflow { .. } => {
                Self::bad_request(e.to_string())
            }
            // Only reaches a client if a backend cancels a job whose client is still there.
            BackendError::Cancelled => Self::internal("the request was cancelled by the server"),
            BackendError::Busy(_) => Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            BackendError::Internal(_) => Self::internal(e.to_string()),
        }
    }
}

impl From<CallError> for HttpError {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Submit(e) => e.into(),
            CallError::Backend(e) => e.into(),
            CallError::Busy { retry_after, .. } => {
                Self { retry_after: Some(retry_after), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()) }
            }
            CallError::NoReply => Self::internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies() {
        let e: HttpError = SubmitError::QueueFull { queued: 4, retry_after: 3 }.into();
        assert_eq!((e.status.as_u16(), e.retry_after), (429, Some(3)));
        assert_eq!(e.body()["error"]["type"], "rate_limit_error");
        let e: HttpError = SubmitError::Failed("no weights".into()).into();
        assert_eq!((e.status.as_u16(), e.retry_after), (503, None));
        let e: HttpError = BackendError::ContextOverflow { tokens: 10, limit: 5 }.into();
        assert_eq!(e.status.as_u16(), 400);
        let e: HttpError = BackendError::Busy("the KV cache is full".into()).into();
        assert_eq!((e.status.as_u16(), e.retry_after), (503, Some(1)));
        let e: HttpError = CallError::Busy { message: "the KV cache is full".into(), retry_after: 7 }.into();
        assert_eq!((e.status.as_u16(), e.retry_after), (503, Some(7)));
        assert!(e.message.contains("retry in 7 s"), "{}", e.message);
        let e: HttpError = BackendError::Internal("boom".into()).into();
        assert_eq!((e.status.as_u16(), e.body()["error"]["type"].as_str()), (500, Some("server_error")));
        let e = HttpError::not_found("no model `x`").with_code("model_not_found");
        let b = e.body();
        assert_eq!(
            (b["error"]["code"].as_str(), b["error"]["type"].as_str()),
            (Some("model_not_found"), Some("invalid_request_error"))
        );
        let e = HttpError::from_json(&JsonPayloadError::OverflowKnownLength { length: 10, limit: 5 });
        assert_eq!(e.status.as_u16(), 413);
        assert!(e.message.contains("10 bytes") && e.message.contains("limit of 5"), "{}", e.message);
    }
}
