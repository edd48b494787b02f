//! Listing the objects under a prefix: the shards of a sharded input (`publish gs://b/exports/`).
//!
//! The official crate lists objects only through its gRPC control client, which the emulator
//! (fake-gcs-server) does not serve; this asks Cloud Storage's JSON API instead (the same one
//! the crate's reads go through), with the credentials the crate itself would use.

use super::{Gcs, StorageError};

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// `gs://bucket/object`.
    pub uri: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its generation: a new one each time the object is written.
    pub generation: String,
}

/// One page of the JSON API's answer.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Page {
    #[serde(default)]
    items: Vec<Item>,
    next_page_token: Option<String>,
}

#[derive(serde::Deserialize)]
struct Item {
    name: String,
    /// A decimal string in the JSON API.
    size: String,
    /// Also a decimal string.
    #[serde(default)]
    generation: String,
}

impl Gcs {
    /// Every object whose name starts with `uri`'s object part (`gs://bucket/prefix`), in name
    /// order, page after page.
    pub async fn list(&self, uri: &str) -> Result<Vec<Listed>, StorageError> {
        let (bucket, prefix) = split_prefix(uri)?;
        let url = format!(
            "{}/storage/v1/b/{}/o",
            self.endpoint.trim_end_matches('/'),
            percent_encoding::utf8_percent_encode(&bucket, percent_encoding::NON_ALPHANUMERIC)
        );
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut query = vec![
                ("prefix", prefix.clone()),
                (
                    "fields",
                    "items(name,size,generation),nextPageToken".to_string(),
                ),
            ];
            if let Some(t) = &token {
                query.push(("pageToken", t.clone()));
            }
            let page = self.list_page(uri, &url, &query).await?;
            for item in page.items {
                let size = item.size.parse().unwrap_or(0);
                out.push(Listed {
                    uri: format!("gs://{bucket}/{}", item.name),
                    size,
                    generation: item.generation,
                });
            }
            match page.next_page_token.filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        out.sort_by(|a, b| a.uri.cmp(&b.uri));
        Ok(out)
    }

    /// One page of a listing.
    async fn list_page(
        &self,
        uri: &str,
        url: &str,
        query: &[(&str, String)],
    ) -> Result<Page, StorageError> {
        let refused = |status: String, detail: String| StorageError::Refused {
            uri: uri.to_string(),
            status,
            detail,
        };
        let mut request = self.http.get(url).query(query);
        if let Some(credentials) = &self.credentials {
            request = request.headers(auth_headers(credentials).await?);
        }
        let response = request
            .send()
            .await
            .map_err(|e| refused("no answer".into(), e.to_string()))?;
        let status = response.status();
        if status.as_u16() == 404 {
            return Err(StorageError::NotFound(uri.to_string()));
        }
        let body = response
            .text()
            .await
            .map_err(|e| refused(format!("HTTP {status}"), e.to_string()))?;
        if !status.is_success() {
            return Err(refused(
                format!("HTTP {status}"),
                body.chars().take(300).collect(),
            ));
        }
        serde_json::from_str(&body).map_err(|e| refused("unreadable listing".into(), e.to_string()))
    }
}

/// The bucket and object prefix of `gs://bucket[/prefix]` (the prefix may be empty).
fn split_prefix(uri: &str) -> Result<(String, String), StorageError> {
    let rest = uri
        .strip_prefix("gs://")
        .filter(|r| !r.is_empty() && !r.starts_with('/'))
        .ok_or_else(|| StorageError::BadUri(uri.chars().take(80).collect()))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    Ok((bucket.to_string(), prefix.to_string()))
}

/// The `Authorization` headers the credentials give now.
async fn auth_headers(
    credentials: &google_cloud_auth::credentials::Credentials,
) -> Result<reqwest::header::HeaderMap, StorageError> {
    use google_cloud_auth::credentials::CacheableResource;
    match credentials.headers(http::Extensions::new()).await {
        Ok(CacheableResource::New { data, .. }) => Ok(data),
        Ok(CacheableResource::NotModified) => Ok(reqwest::header::HeaderMap::new()),
        Err(e) => Err(StorageError::Client(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_may_be_empty_or_end_in_a_slash() {
        let split = |u| split_prefix(u).unwrap();
        assert_eq!(split("gs://b"), ("b".into(), String::new()));
        assert_eq!(split("gs://b/"), ("b".into(), String::new()));
        assert_eq!(split("gs://b/exports/"), ("b".into(), "exports/".into()));
        assert_eq!(
            split("gs://b/exports/part-"),
            ("b".into(), "exports/part-".into())
        );
        assert!(split_prefix("/local/path").is_err());
    }
}
